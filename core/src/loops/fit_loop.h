// Internal: the fit loop (Lightning's _FitLoop): the loaders and their sizes, the sanity check,
// epochs until a limit or a stop, and the position (epoch, global step) the run is at.
#pragma once

#include <fulgur/data_module.h>
#include <fulgur/trainer.h>

#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "../hook_dispatcher.h"
#include "training_epoch_loop.h"

namespace fulgur {

class FitLoop {
 public:
  explicit FitLoop(TrainerEngine& trainer) : trainer_(trainer), epoch_loop_(trainer, *this, position_) {}

  // From the loaders to on_fit_end's predecessor on_train_end: sets up the train and validation
  // loaders, runs the sanity check, then epochs until done().
  void run();
  // Whether fit ends here: max_steps / max_epochs reached, or (once min_epochs and min_steps are
  // met) a requested stop. [trainer] max_time is a callback that requests one (plugin_connector).
  bool done();

  // After a signal stopped fit (the process exits next): no loader thread may outlive exit.
  void release_loaders() {
    epoch_loop_.forget_loader();
    train_loader_.reset();
    val_loaders_.clear();
  }
  // From run()'s start to its end: the loaders exist or are being built, batches are training.
  bool running() const { return running_; }
  const RunPosition& position() const { return position_; }
  TrainingEpochLoop& epoch_loop() { return epoch_loop_; }
  const TrainingEpochLoop& epoch_loop() const { return epoch_loop_; }

  // The checkpoint's loops.fit_loop: epoch, the CPU RNG, and the epoch loop's state, with the
  // same position in Lightning 2.6's keys (lightning_progress.h). Only Fulgur's keys are read back.
  c10::IValue state_dict() const;
  // Restores it. A checkpoint written during the epoch-end work counts that epoch as complete
  // and runs what followed the callbacks (epoch schedulers that need no metric, as Lightning).
  void load_state_dict(const c10::IValue& state, const std::string& path);

 private:
  // Asks the DataModule for the loaders (at the start, and every reload_dataloaders_every_n_epochs).
  void setup_data();
  void run_sanity_check();

  TrainerEngine& trainer_;
  RunPosition position_;
  TrainingEpochLoop epoch_loop_;
  std::unique_ptr<BatchLoader> train_loader_;
  std::vector<std::unique_ptr<BatchLoader>> val_loaders_;
  int64_t loaders_epoch_ = -1;  // the epoch the loaders were last asked for
  bool running_ = false;
};

}  // namespace fulgur
