// fulgur::Trainer — runs fit / validate / test / predict for a Module and a DataModule with the
// plugins a TOML config selects by name, in PyTorch Lightning's hook order.
#pragma once

#include <fulgur/config.h>
#include <fulgur/types.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

class Callback;
class DataModule;
class Module;

class Trainer {
 public:
  // Resolves every plugin the config selects, checks their options, then loads and creates them.
  explicit Trainer(Config config);
  static Trainer from_toml(const std::filesystem::path& file);
  ~Trainer();
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  // Extra callbacks given in code (run after the configured ones, in insertion order).
  Trainer& add_callback(std::shared_ptr<Callback> callback);

  // ckpt_path: "" (fresh), a path, "last" or "best" (from the model_checkpoint callback).
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

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulgur
