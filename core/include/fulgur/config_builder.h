// ConfigBuilder: the Trainer configured in code, in LibTorch's options style. The run's
// configuration is one concept, Config: TOML is one front end that produces it, this builder is the
// other (named TrainerOptions before 1.1; that name stays as an alias in 1.x).
//
//   fulgur::Trainer trainer(fulgur::ConfigBuilder()
//                               .max_epochs(5)
//                               .precision("bf16-mixed")
//                               .seed(42)
//                               .callback("early_stopping", fulgur::Options().set("monitor", "val/loss"))
//                               .logger("csv"));
//
// Every setter writes a [trainer] key of trainer_option_schema(); set(key, value) reaches any of
// them by name and refuses an unknown key or a wrong type on the spot. Plugin options are checked
// against the plugin's schema when the Trainer is built, like a TOML table.
#pragma once

#include <fulgur/config.h>

#include <filesystem>
#include <string>

namespace fulgur {

class ConfigBuilder {
 public:
  ConfigBuilder();

  // Any [trainer] key by name (see trainer_option_schema()); throws fulgur::Error(config) for an
  // unknown key (with a suggestion) or a value of the wrong type.
  ConfigBuilder& set(const std::string& key, OptionValue value);

  ConfigBuilder& accelerator(std::string name, Options options = {});
  ConfigBuilder& strategy(std::string name, Options options = {});
  ConfigBuilder& precision(std::string name, Options options = {});
  ConfigBuilder& profiler(std::string name, Options options = {});
  /// [storage]: the storage plugin `name` (the URL scheme it serves) with `options`.
  ConfigBuilder& storage(std::string name, Options options = {});
  ConfigBuilder& logger(std::string name, Options options = {});
  ConfigBuilder& callback(std::string name, Options options = {});
  ConfigBuilder& plugin_path(std::filesystem::path directory);
  ConfigBuilder& model_hparams(Options hparams);
  ConfigBuilder& data_hparams(Options hparams);

  ConfigBuilder& devices(std::string spec) { return set("devices", std::move(spec)); }
  ConfigBuilder& devices(int64_t count) { return set("devices", std::to_string(count)); }
  ConfigBuilder& num_nodes(int64_t v) { return set("num_nodes", v); }
  ConfigBuilder& max_epochs(int64_t v) { return set("max_epochs", v); }
  ConfigBuilder& min_epochs(int64_t v) { return set("min_epochs", v); }
  ConfigBuilder& max_steps(int64_t v) { return set("max_steps", v); }
  ConfigBuilder& min_steps(int64_t v) { return set("min_steps", v); }
  ConfigBuilder& max_time(std::string v) { return set("max_time", std::move(v)); }
  // Batch limits: an integer is a count, a floating-point value a fraction of the loader.
  ConfigBuilder& limit_train_batches(OptionValue v) { return set("limit_train_batches", std::move(v)); }
  ConfigBuilder& limit_val_batches(OptionValue v) { return set("limit_val_batches", std::move(v)); }
  ConfigBuilder& limit_test_batches(OptionValue v) { return set("limit_test_batches", std::move(v)); }
  ConfigBuilder& limit_predict_batches(OptionValue v) { return set("limit_predict_batches", std::move(v)); }
  ConfigBuilder& val_check_interval(OptionValue v) { return set("val_check_interval", std::move(v)); }
  ConfigBuilder& check_val_every_n_epoch(int64_t v) { return set("check_val_every_n_epoch", v); }
  ConfigBuilder& reload_dataloaders_every_n_epochs(int64_t v) { return set("reload_dataloaders_every_n_epochs", v); }
  ConfigBuilder& num_sanity_val_steps(int64_t v) { return set("num_sanity_val_steps", v); }
  ConfigBuilder& log_every_n_steps(int64_t v) { return set("log_every_n_steps", v); }
  ConfigBuilder& accumulate_grad_batches(int64_t v) { return set("accumulate_grad_batches", v); }
  ConfigBuilder& gradient_clip_val(double v) { return set("gradient_clip_val", v); }
  ConfigBuilder& gradient_clip_algorithm(std::string v) { return set("gradient_clip_algorithm", std::move(v)); }
  ConfigBuilder& deterministic(bool v) { return set("deterministic", v); }
  /// Lightning's deterministic = "warn": deterministic algorithms, a warning (not an error) where
  /// an operation has none.
  ConfigBuilder& deterministic(std::string v) { return set("deterministic", std::move(v)); }
  ConfigBuilder& deterministic(const char* v) { return set("deterministic", std::string(v)); }  // not the bool one
  ConfigBuilder& seed(int64_t v) { return set("seed", v); }
  ConfigBuilder& fast_dev_run(int64_t v) { return set("fast_dev_run", v); }
  ConfigBuilder& default_root_dir(std::filesystem::path v) { return set("default_root_dir", v.string()); }
  ConfigBuilder& enable_checkpointing(bool v) { return set("enable_checkpointing", v); }
  ConfigBuilder& enable_progress_bar(bool v) { return set("enable_progress_bar", v); }
  ConfigBuilder& enable_model_summary(bool v) { return set("enable_model_summary", v); }
  ConfigBuilder& inference_mode(bool v) { return set("inference_mode", v); }
  ConfigBuilder& detect_anomaly(bool v) { return set("detect_anomaly", v); }
  /// `[trainer] sync_batchnorm`: fulgur::nn::BatchNorm layers use every data-parallel rank's batch.
  ConfigBuilder& sync_batchnorm(bool v) { return set("sync_batchnorm", v); }
  ConfigBuilder& default_logger(bool v) { return set("logger", v); }
  ConfigBuilder& barebones(bool v) { return set("barebones", v); }
  ConfigBuilder& ckpt_path(std::string v) { return set("ckpt_path", std::move(v)); }
  ConfigBuilder& interrupt_checkpoint(std::string v) { return set("interrupt_checkpoint", std::move(v)); }
  ConfigBuilder& requeue_signal(std::string v) { return set("requeue_signal", std::move(v)); }
  ConfigBuilder& log_level(std::string level);

  // The Config the Trainer is built from (plugin tables are checked when the Trainer is built).
  const Config& to_config() const { return config_; }

 private:
  Config config_;
};

/// The name of ConfigBuilder before SDK 1.1, kept for source compatibility within 1.x.
using TrainerOptions = ConfigBuilder;

}  // namespace fulgur
