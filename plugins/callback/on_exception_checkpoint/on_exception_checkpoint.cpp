// Built-in callback `on_exception_checkpoint`: Lightning's OnExceptionCheckpoint. When fit fails
// with an exception, saves a full checkpoint to `<dirpath>/<filename>.ckpt` (overwriting an older
// one), so the run can be resumed or inspected with ckpt_path = that file.
//
// The checkpoint holds the state at the failure, as Lightning's does: a failure inside a batch
// saves the weights and counters as they were when it was raised (a resume starts that batch
// again). With several processes nothing is saved: writing a checkpoint is collective (rank zero
// writes, all wait) and the other ranks are not waiting for one; a warning says so.
#include <fulgur/plugin.h>

#include <fmt/format.h>

#include <exception>
#include <string>

#include "../common/callback_conventions.h"

namespace {

constexpr char kOwner[] = "callback 'on_exception_checkpoint'";

class OnExceptionCheckpoint final : public fulgur::CallbackBase<OnExceptionCheckpoint> {
 public:
  FULGUR_OPTIONS(Options, (string, dirpath, "Directory of the checkpoint (\"\": default_root_dir)", ""),
                 (string, filename, "File name without extension (\".ckpt\" is added)", "on_exception"));
  explicit OnExceptionCheckpoint(const Options& options) : dirpath_(options.dirpath), filename_(options.filename) {
    options.check(
        !(filename_.empty() || filename_.find('/') != std::string::npos || filename_ == "." || filename_ == ".."),
        "filename", "must be a file name without '/' (\".ckpt\" is added)");
  }

  // Only a fit that got as far as starting has a model and optimizers worth saving.
  void on_fit_start(fulgur::TrainerContext&) override { armed_ = true; }
  void teardown(fulgur::TrainerContext&, fulgur::Stage) override { armed_ = false; }

  void on_exception(fulgur::TrainerContext& trainer, const std::exception&) override {
    if (!armed_ || trainer.stage() != fulgur::Stage::fit) return;
    armed_ = false;
    if (trainer.cluster().world_size > 1) {
      fulgur::log::warn(
          fmt::format("{}: not saving: with {} processes a checkpoint is written by all of them "
                      "together, and the others are not waiting for one",
                      kOwner, trainer.cluster().world_size));
      return;
    }
    const std::string path = ckpt_path(trainer);
    trainer.save_checkpoint(path, /*weights_only=*/false);
    fulgur::log::warn(fmt::format("{}: saved {} (epoch {}, global step {}) after the failure", kOwner, path,
                                  trainer.current_epoch(), trainer.global_step()));
  }

  // Lightning's ckpt_path property: dirpath (default_root_dir when empty, a URL one included:
  // fulgur/storage_root.h) / filename + ".ckpt".
  std::string ckpt_path(fulgur::TrainerContext& trainer) const {
    const std::string dir = dirpath_.empty() ? fulgur::callback_conventions::default_root(trainer) : dirpath_;
    return (dir.empty() ? std::string(".") : dir) + "/" + filename_ + ".ckpt";
  }

 private:
  std::string dirpath_;
  std::string filename_;
  bool armed_ = false;
};

}  // namespace

FULGUR_PLUGIN(OnExceptionCheckpoint, "on_exception_checkpoint", "1.0.0",
              "Saves a checkpoint when fit fails with an exception (Lightning's OnExceptionCheckpoint)")
