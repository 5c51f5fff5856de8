/// @file
/// CheckpointSaveQueue: an extension (SDK 1.5) of TrainerContext through which a callback learns
/// that a checkpoint is still being written in the background ([trainer] async_checkpoint) and
/// defers what must wait for it, such as deleting the checkpoint the new one replaces: a process
/// killed while the new file is being written then still has the old one. The host's
/// TrainerContext offers it:
///
///   if (auto* queue = fulgur::find_extension<fulgur::CheckpointSaveQueue>(trainer))
///     queue->after_pending_save([path] { remove(path); });
///   else
///     remove(path);  // a host without it saves synchronously: the new file is complete
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace fulgur {

/// The checkpoint save in flight, and work deferred until it is complete. SDK 1.5.
class CheckpointSaveQueue {
 public:
  /// The extension's id (fulgur/extension.h). SDK 1.5.
  static constexpr std::string_view kExtensionId = "fulgur.trainer_context.checkpoint_save_queue/1";
  /// The path of the checkpoint being written in the background, or "" when none is (synchronous
  /// saves, or the last background save already awaited). SDK 1.5.
  virtual std::string pending_save() const = 0;
  /// Runs `action` on the training thread once the checkpoint being written in the background is
  /// complete (on every rank, where several write), or at once when none is. Deferred actions run
  /// in the order given, when the host awaits that save: at the next save, at the end of a stage
  /// and of fit. When that save fails they are dropped (the run fails naming the checkpoint), so a
  /// file the failed save was to replace is kept. An action that throws fails the run as the
  /// save would. Called on the training thread only. SDK 1.5.
  virtual void after_pending_save(std::function<void()> action) = 0;

 protected:
  ~CheckpointSaveQueue() = default;
};

}  // namespace fulgur
