// Internal: checkpoints of a run (Lightning's _CheckpointConnector): what a checkpoint holds
// beyond the strategy's model and optimizer parts, where "last" and "best" are (asked of the
// checkpoint-provider callbacks), and restoring a run from one.
#pragma once

#include <fulgur/trainer.h>
#include <fulgur/types.h>
#include <fulgur/weights.h>

#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

namespace fulgur {

class CheckpointConnector {
 public:
  explicit CheckpointConnector(TrainerEngine& trainer) : trainer_(trainer) {}

  // A checkpoint as the strategy read it, in parts.
  struct ReadCheckpoint {
    std::string path;
    std::shared_ptr<c10::IValue> model_state, metadata;  // metadata: a dict of the other keys
    std::vector<c10::IValue> optimizer_states;           // empty: a weights-only checkpoint
  };

  // TrainerContext::save_checkpoint: the strategy's parts plus dump_metadata, written by the strategy.
  void save(const std::string& path, bool weights_only);
  // A path, "last" or "best" as a file. "" when ckpt_path is "last" in fit and no last
  // checkpoint exists yet (a first run starts fresh, with a warning, as Lightning does).
  std::string resolve(const std::string& ckpt_path, Stage stage);
  ReadCheckpoint read(const std::string& path, bool with_optimizer_states);
  // The model's weights; [trainer] strict_loading decides whether unmatched keys are refused.
  void restore_model(const ReadCheckpoint& checkpoint);
  // on_load_checkpoint of every callback, then each stateful callback's own state.
  void restore_callbacks(const ReadCheckpoint& checkpoint);
  // Optimizers, schedulers, precision, and every loop's state (exact resume).
  void restore_training_state(const ReadCheckpoint& checkpoint);

  // fit's checkpoint, read whole; a file fit cannot resume is refused naming why and pointing to
  // [trainer] init_weights: weights only (safetensors, a torch.save state dict), or a checkpoint
  // of Python's Lightning (its loops lack Fulgur's exact-resume state).
  ReadCheckpoint read_for_resume(const std::string& path);
  // validate / test / predict: the weights of `ckpt_path` (a checkpoint, or weights only: a
  // safetensors file or a bare state dict, keys as they are), or without one [trainer]
  // init_weights. Logs the file it loads.
  void restore_model_for(Stage stage, const std::string& ckpt_path);
  // [trainer] init_weights into the model (nothing when it is empty); after configure_model.
  void load_init_weights(Stage stage);

 private:
  // Every top-level key but the model and optimizer states.
  c10::IValue dump_metadata(bool weights_only);
  // strict_loading = false: one warning naming the model's keys the checkpoint lacks and the
  // checkpoint's keys the model lacks (rank 0).
  void warn_unmatched_keys(const c10::IValue& model_state, const std::string& path);
  void check_resumable(const ReadCheckpoint& checkpoint);
  static bool is_weights_only_file(const std::string& path);
  static std::string init_weights_hint(const std::string& path);
  void restore_weights_only(const std::string& path, const TensorMap& tensors);

  TrainerEngine& trainer_;
};

}  // namespace fulgur
