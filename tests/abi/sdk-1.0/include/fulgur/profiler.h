/// @file
/// Profiler: measures named actions of the Trainer ("run_training_batch", "optimizer_step",
/// "[Callback]model_checkpoint.on_train_epoch_end", ...).
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <string>
#include <string_view>

namespace fulgur {

/// Measures named actions. Created when the Trainer is built (when `[profiler]` selects one and
/// the run is not barebones) and owned by it for its whole life. Every method is called on every
/// rank, from the thread that runs the Trainer's stages; none is a collective. start and stop are
/// on the hot path (several pairs per training batch, one per callback hook call): keep them cheap.
class FULGUR_SDK_API Profiler {
 public:
  virtual ~Profiler();

  /// Called at the start of every stage, after the loggers are set up. `log_dir` is the run's
  /// directory (rank zero's, the same on every rank); `global_rank` > 0 in a multi-process run:
  /// files get a rank suffix so that ranks sharing rank 0's log_dir do not overwrite each other.
  virtual void setup(Stage stage, const std::string& log_dir, int64_t global_rank) = 0;
  /// An action begins. Actions nest (a hook inside a batch) and each start is matched by one
  /// stop of the same name, in LIFO order. `action` stays valid at least until teardown of this
  /// stage (the Trainer's action names); copy it to keep it longer.
  virtual void start(std::string_view action) = 0;
  /// The innermost running action named `action` ends. Must not throw (ProfileScope calls it from
  /// its destructor, also while an exception unwinds).
  virtual void stop(std::string_view action) = 0;
  /// A human-readable report of what was measured so far. Not called by the Trainer (a profiler
  /// writes its report itself, typically in teardown); for users and the testing kit.
  virtual std::string summary() const = 0;
  /// Called at the end of every stage, also a failed one: write the report for `stage`.
  virtual void teardown(Stage stage) = 0;
  /// The extension interface named `id` that this profiler implements, or nullptr (the default).
  /// Capabilities added after SDK 1.0 arrive this way; see fulgur/extension.h. Must not throw.
  virtual void* extension(std::string_view id) noexcept;
};

/// RAII action: `{ ProfileScope scope(profiler, "optimizer_step"); ... }`; null profiler = no-op.
/// Keeps a view of `action` and a pointer to `profiler`: both must outlive the scope.
class ProfileScope {
 public:
  /// Starts `action` on `profiler` (nothing when it is null).
  ProfileScope(Profiler* profiler, std::string_view action) : profiler_(profiler), action_(action) {
    if (profiler_) profiler_->start(action_);
  }
  /// Stops the action.
  ~ProfileScope() {
    if (profiler_) profiler_->stop(action_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* profiler_;
  std::string_view action_;
};

}  // namespace fulgur
