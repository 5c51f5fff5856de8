// Internal: ResolvedTrainerConfig, the Config's [trainer] table checked and resolved once into the
// typed values the loops read (one concept, "the configuration", spelled Config throughout:
// Config is the run's, ConfigBuilder writes one in code, this is its [trainer] part resolved).
#pragma once

#include <fulgur/config.h>
#include <fulgur/options.h>
#include <fulgur/types.h>

#include <cstdint>
#include <string>

namespace fulgur {

// Batch limits from limit_*_batches: an integer is a count, a float a fraction of the loader.
// Unknown lengths (-1) stay unknown unless the limit is a count.
int64_t apply_batch_limit(const OptionValue& limit, int64_t available);
// Every [trainer] value check the Trainer makes, without building anything (config check uses it).
void validate_trainer_values(const Config& config);

// [trainer] cuda_graphs: whether training steps are captured and replayed (capture/step_capture.h).
enum class StepCaptureMode { off, on, try_ };

struct ResolvedTrainerConfig {
  // Checks `config` (validate_trainer_values) and resolves it: Lightning's defaults (max_epochs
  // 1000 when neither limit is set) and fast_dev_run's overrides applied.
  static ResolvedTrainerConfig from_config(const Config& config);

  // The local root every plugin sees (TrainerContext::default_root_dir): default_root_dir, or
  // staging_dir when default_root_dir is a URL, which default_root_url then holds (else "").
  std::string default_root_dir, default_root_url;
  // Where files that follow default_root_dir go when they may live on object storage (the
  // checkpoint written on a signal): default_root_url, else default_root_dir.
  const std::string& checkpoint_root() const { return default_root_url.empty() ? default_root_dir : default_root_url; }
  int64_t max_epochs = -1, max_steps = -1, min_epochs = 0, min_steps = 0;
  int64_t reload_dataloaders_every_n_epochs = 0;
  int64_t check_val_every_n_epoch = 1, num_sanity_val_steps = 2, log_every_n_steps = 50;
  int64_t accumulate_grad_batches = 1, fast_dev_run = 0;
  double gradient_clip_val = 0;
  GradClipAlgorithm gradient_clip_algorithm = GradClipAlgorithm::norm;
  bool inference_mode = true, detect_anomaly = false;
  bool strict_loading = true;     // Lightning's LightningModule.strict_loading, for every ckpt_path
  bool async_checkpoint = false;  // checkpoints written in a background thread (async_checkpoint.h)
  // [trainer] init_weights*: the weights a model starts from when no checkpoint is restored.
  struct InitWeights {
    std::string path;  // "" for none; absolute when it came from a TOML file
    std::string strip_prefix, add_prefix;
    bool strict = true;
  } init_weights;
  bool barebones = false;  // no sanity check, log() a no-op (plugin_connector drops the rest)
  StepCaptureMode cuda_graphs = StepCaptureMode::off;
  // An integer is a count of batches, a float a fraction (apply_batch_limit).
  OptionValue limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches, overfit_batches;
  bool overfit = false;                 // overfit_batches > 0: train and validate on the same few batches
  bool use_distributed_sampler = true;  // loaders get set_replica(rank, world) (false: each reads all)
  bool return_predictions = true;       // predict collects its outputs (false: writer-only runs)
  bool sync_batchnorm = false;          // fulgur::nn::BatchNorm layers use every data-parallel rank's batch
  OptionValue val_check_interval;
};

}  // namespace fulgur
