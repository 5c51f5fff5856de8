/// @file
/// AsyncSaveStrategy: an extension (SDK 1.5) of Strategy through which a multi-process strategy
/// saves checkpoints in the background ([trainer] async_checkpoint). Strategy::save_checkpoint is
/// a collective (barriers, the gather of a sharded checkpoint's metadata), and collectives must
/// not run on a background thread beside the training step's. This extension splits the save in
/// three, so that only the middle part, which talks to no other rank, runs in the background:
///
///   training thread, every rank:  write = prepare_save(parts, path)      (collective)
///   background thread:            write()                                (this rank's bytes only)
///   training thread, every rank:  wait; agree whether every rank's write() succeeded;
///                                 finish_save(path, all_written)         (collective)
///
/// The host awaits a save at the next save, at the end of a stage and at the end of fit. When any
/// rank's write failed, finish_save still runs (with all_written = false) and then the run fails on
/// every rank naming the checkpoint and the failing ranks. A strategy without the extension saves
/// synchronously in a multi-process run (with a warning); single-process runs write through
/// Strategy::save_checkpoint on the background thread, as before.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace fulgur {

struct CheckpointParts;

/// A strategy whose checkpoint save splits into a collective preparation, a background write of
/// this rank's part without collectives, and a collective completion. SDK 1.5.
class AsyncSaveStrategy {
 public:
  /// The extension's id (fulgur/extension.h). SDK 1.5.
  static constexpr std::string_view kExtensionId = "fulgur.strategy.async_save/1";
  /// Called on the training thread of every rank where Strategy::save_checkpoint would be (a
  /// collective: it may create directories, plan a sharded layout, talk to the other ranks), with
  /// `parts` already copied to host memory by the host. Returns this rank's write (may be empty: no
  /// bytes to write on this rank), which the host runs on a background thread while training goes
  /// on: it must not use collectives or the strategy's device state. The values `parts` points to
  /// stay alive and unchanged until that write has returned, so it may capture the pointers.
  /// Throws fulgur::Error (io, checkpoint) like save_checkpoint, on the training thread. SDK 1.5.
  virtual std::function<void()> prepare_save(const CheckpointParts& parts, const std::string& path) = 0;
  /// Called on the training thread of every rank (a collective) once every rank's write for `path`
  /// has returned; `all_written` is whether all of them succeeded (the host agreed it across
  /// ranks). Completes the checkpoint when they did (rank 0 writes a sharded checkpoint's
  /// metadata, the marker that makes it one) or cleans up when they did not, so that a failed save
  /// leaves nothing that looks like a complete checkpoint and is not one. Throws fulgur::Error (io, checkpoint)
  /// when it cannot complete it. SDK 1.5.
  virtual void finish_save(const std::string& path, bool all_written) = 0;

 protected:
  ~AsyncSaveStrategy() = default;
};

}  // namespace fulgur
