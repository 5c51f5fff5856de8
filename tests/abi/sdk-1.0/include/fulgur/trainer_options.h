// TrainerOptions: the Trainer configured in code, in LibTorch's options style. TOML is one front
// end that produces the same Config; this is the other.
//
//   fulgur::Trainer trainer(fulgur::TrainerOptions()
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

class TrainerOptions {
 public:
  TrainerOptions();

  // Any [trainer] key by name (see trainer_option_schema()); throws fulgur::Error(config) for an
  // unknown key (with a suggestion) or a value of the wrong type.
  TrainerOptions& set(const std::string& key, OptionValue value);

  TrainerOptions& accelerator(std::string name, Options options = {});
  TrainerOptions& strategy(std::string name, Options options = {});
  TrainerOptions& precision(std::string name, Options options = {});
  TrainerOptions& profiler(std::string name, Options options = {});
  TrainerOptions& logger(std::string name, Options options = {});
  TrainerOptions& callback(std::string name, Options options = {});
  TrainerOptions& plugin_path(std::filesystem::path directory);
  TrainerOptions& model_hparams(Options hparams);
  TrainerOptions& data_hparams(Options hparams);

  TrainerOptions& devices(std::string spec) { return set("devices", std::move(spec)); }
  TrainerOptions& devices(int64_t count) { return set("devices", std::to_string(count)); }
  TrainerOptions& num_nodes(int64_t v) { return set("num_nodes", v); }
  TrainerOptions& max_epochs(int64_t v) { return set("max_epochs", v); }
  TrainerOptions& min_epochs(int64_t v) { return set("min_epochs", v); }
  TrainerOptions& max_steps(int64_t v) { return set("max_steps", v); }
  TrainerOptions& min_steps(int64_t v) { return set("min_steps", v); }
  TrainerOptions& max_time(std::string v) { return set("max_time", std::move(v)); }
  // Batch limits: an integer is a count, a floating-point value a fraction of the loader.
  TrainerOptions& limit_train_batches(OptionValue v) { return set("limit_train_batches", std::move(v)); }
  TrainerOptions& limit_val_batches(OptionValue v) { return set("limit_val_batches", std::move(v)); }
  TrainerOptions& limit_test_batches(OptionValue v) { return set("limit_test_batches", std::move(v)); }
  TrainerOptions& limit_predict_batches(OptionValue v) { return set("limit_predict_batches", std::move(v)); }
  TrainerOptions& val_check_interval(OptionValue v) { return set("val_check_interval", std::move(v)); }
  TrainerOptions& check_val_every_n_epoch(int64_t v) { return set("check_val_every_n_epoch", v); }
  TrainerOptions& reload_dataloaders_every_n_epochs(int64_t v) {
    return set("reload_dataloaders_every_n_epochs", v);
  }
  TrainerOptions& num_sanity_val_steps(int64_t v) { return set("num_sanity_val_steps", v); }
  TrainerOptions& log_every_n_steps(int64_t v) { return set("log_every_n_steps", v); }
  TrainerOptions& accumulate_grad_batches(int64_t v) { return set("accumulate_grad_batches", v); }
  TrainerOptions& gradient_clip_val(double v) { return set("gradient_clip_val", v); }
  TrainerOptions& gradient_clip_algorithm(std::string v) { return set("gradient_clip_algorithm", std::move(v)); }
  TrainerOptions& deterministic(bool v) { return set("deterministic", v); }
  TrainerOptions& seed(int64_t v) { return set("seed", v); }
  TrainerOptions& fast_dev_run(int64_t v) { return set("fast_dev_run", v); }
  TrainerOptions& default_root_dir(std::filesystem::path v) { return set("default_root_dir", v.string()); }
  TrainerOptions& enable_checkpointing(bool v) { return set("enable_checkpointing", v); }
  TrainerOptions& enable_progress_bar(bool v) { return set("enable_progress_bar", v); }
  TrainerOptions& enable_model_summary(bool v) { return set("enable_model_summary", v); }
  TrainerOptions& inference_mode(bool v) { return set("inference_mode", v); }
  TrainerOptions& detect_anomaly(bool v) { return set("detect_anomaly", v); }
  TrainerOptions& default_logger(bool v) { return set("logger", v); }
  TrainerOptions& barebones(bool v) { return set("barebones", v); }
  TrainerOptions& ckpt_path(std::string v) { return set("ckpt_path", std::move(v)); }
  TrainerOptions& interrupt_checkpoint(std::string v) { return set("interrupt_checkpoint", std::move(v)); }
  TrainerOptions& requeue_signal(std::string v) { return set("requeue_signal", std::move(v)); }
  TrainerOptions& log_level(std::string level);

  // The Config the Trainer is built from (plugin tables are checked when the Trainer is built).
  const Config& to_config() const { return config_; }

 private:
  Config config_;
};

}  // namespace fulgur
