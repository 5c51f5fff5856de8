// fulgur::Trainer — runs fit / validate / test / predict for a Module and a DataModule with the
// plugins a TOML config selects by name, in PyTorch Lightning's hook order.
#pragma once

#include <fulgur/config.h>
#include <fulgur/config_builder.h>
#include <fulgur/types.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

class Callback;
class DataModule;
class Module;
class Precision;
class Strategy;
class TrainerContext;

class TrainerEngine;  // the engine behind this facade (core/src/trainer_engine.h)

class Trainer {
 public:
  // Resolves every plugin the config selects, checks their options, then loads and creates them.
  explicit Trainer(Config config);
  // The Trainer configured in code (ConfigBuilder); the same checks as a TOML file.
  explicit Trainer(const ConfigBuilder& options);
  static Trainer from_toml(const std::filesystem::path& file);
  ~Trainer();
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  // Extra callbacks given in code (run after the configured ones, in insertion order; callbacks
  // with the checkpoint role still run last). `name` appears in profiler scopes and errors.
  Trainer& add_callback(std::shared_ptr<Callback> callback, std::string name = "user");

  // ckpt_path: "" (fresh; for fit, [trainer] ckpt_path applies), a path, "last" or "best" (asked
  // of the callbacks that provide checkpoints). For fit, "last" with no last checkpoint yet starts
  // fresh with a warning, as Lightning does, so one config serves the first run and every restart.
  void fit(Module& module, DataModule& data, const std::string& ckpt_path = "");
  std::vector<MetricMap> validate(Module& module, DataModule& data, const std::string& ckpt_path = "");
  std::vector<MetricMap> test(Module& module, DataModule& data, const std::string& ckpt_path = "");
  std::vector<at::Tensor> predict(Module& module, DataModule& data, const std::string& ckpt_path = "");

  // Writes a full checkpoint of the current state (what model_checkpoint calls).
  void save_checkpoint(const std::string& path, bool weights_only = false);

  int64_t current_epoch() const;
  int64_t global_step() const;
  const MetricMap& callback_metrics() const;
  const MetricMap& logged_metrics() const;
  bool should_stop() const;
  const Config& config() const;
  std::string log_dir() const;
  // This process's place in a multi-process run (0 and true before the first stage starts it).
  int64_t global_rank() const;
  bool is_global_zero() const { return global_rank() == 0; }

  // What plugins see (for tests and tools driving a plugin by hand).
  TrainerContext& context();
  // The running strategy and precision plugins (Lightning's trainer.strategy / .precision_plugin).
  Strategy& strategy();
  Precision& precision();

 private:
  std::unique_ptr<TrainerEngine> engine_;
};

}  // namespace fulgur
