// Internal: checkpoints of a run (Lightning's _CheckpointConnector): what a checkpoint holds
// beyond the strategy's model and optimizer parts, where "last" and "best" are (asked of the
// checkpoint-provider callbacks), and restoring a run from one.
#pragma once

#include <fulgur/async_save.h>
#include <fulgur/logger.h>
#include <fulgur/trainer.h>
#include <fulgur/types.h>
#include <fulgur/weights.h>

#include <ATen/core/ivalue.h>

#include "async_checkpoint.h"

#include <functional>
#include <memory>
#include <optional>
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

  // TrainerContext::save_checkpoint: the strategy's parts plus dump_metadata, written by the strategy
  // (in the background with [trainer] async_checkpoint: in a single-process run, or where the
  // strategy offers AsyncSaveStrategy, fulgur/async_save.h).
  void save(const std::string& path, bool weights_only);
  // Waits for a background save still in flight; throws fulgur::Error(checkpoint) naming it when it
  // failed. The loggers hear of a background save (after_save_checkpoint) here, once it is complete.
  // A save split by AsyncSaveStrategy is completed here, which is a collective: every rank agrees
  // which ranks' writes failed, then the strategy's finish_save runs. `collective` = false (the
  // run already failed, other ranks may never come) only waits for this rank's write.
  void wait_for_pending_save(bool collective = true);
  // CheckpointSaveQueue (fulgur/checkpoint_queue.h): the background save's path ("" when none),
  // and work run once it is complete (at once when none is in flight; dropped when it fails).
  std::string pending_save() const { return async_writer_.in_flight().value_or(std::string()); }
  void after_pending_save(std::function<void()> action);
  // A path, "last" or "best" as a file. "" when ckpt_path is "last" in fit and no last
  // checkpoint exists yet (a first run starts fresh, with a warning, as Lightning does).
  std::string resolve(const std::string& ckpt_path, Stage stage);
  ReadCheckpoint read(const std::string& path, bool with_optimizer_states);
  // The model's weights; [trainer] strict_loading decides whether unmatched keys are refused.
  // `stage`: in fit the optimizers exist already (see prepare_learned_scales).
  void restore_model(const ReadCheckpoint& checkpoint, Stage stage);
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
  // Before a load: the fulgur::nn::Linear layers whose learned quantization scales (LSQ, the qat
  // callback's learnable_scales) `state` holds and the model lacks get them, as `fulgur validate |
  // test | predict` do (nn::prepare_learned_scales), so that the checkpoint loads strictly. In fit
  // (`optimizers_set`) new parameters would miss the optimizers: refused, naming the qat callback.
  void prepare_learned_scales(const TensorMap& state, const std::string& path, bool optimizers_set);

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
  // save() with [trainer] async_checkpoint: copies the parts to host memory and has the strategy
  // write them on a background thread (after the previous save completed).
  // `split`: the strategy's AsyncSaveStrategy in a multi-process run (its prepare_save runs here,
  // its write in the background), else nullptr (Strategy::save_checkpoint in the background).
  void save_in_background(const std::string& path, c10::IValue model_state, std::vector<c10::IValue> optimizer_states,
                          c10::IValue metadata, const SavedCheckpoint& saved, AsyncSaveStrategy* split);
  // The global ranks whose background write failed (`failed` is this rank's answer): one all-gather.
  std::vector<int64_t> failed_ranks(bool failed);

  TrainerEngine& trainer_;
  AsyncCheckpointWriter async_writer_;
  std::optional<SavedCheckpoint> pending_;         // the background save's, for the loggers
  std::vector<std::function<void()>> after_save_;  // after_pending_save's actions, in order
  AsyncSaveStrategy* split_ = nullptr;             // the pending save's finish_save, where split
  bool warned_async_multiprocess_ = false;
};

}  // namespace fulgur
