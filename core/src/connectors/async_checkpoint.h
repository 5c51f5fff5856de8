// Internal: [trainer] async_checkpoint (Lightning's AsyncCheckpointIO). At the save point the
// checkpoint's state is copied to host memory (copy_to_host), then written by the strategy in a
// background thread while training goes on. One save is in flight at most: the next save, and the
// end of fit, wait for it; a save that failed fails the run there, naming its checkpoint.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <string>

namespace fulgur {

// A deep copy of `value` whose tensors live in fresh CPU memory that nothing else writes: tensors
// that shared a storage share the copy of it (same bytes, views, offsets and strides), so the file
// written from the copy is the one written from `value`. Dicts, lists and tuples are copied;
// strings and numbers are immutable and kept.
c10::IValue copy_to_host(const c10::IValue& value);

class AsyncCheckpointWriter {
 public:
  AsyncCheckpointWriter() = default;
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;
  // Waits for a save still in flight (an error nobody collected is logged).
  ~AsyncCheckpointWriter();

  // Runs `write` (which saves `path`) on a background thread. The previous save must have been
  // awaited (wait()). `rank` is this process's global rank (for the test-only fault seam).
  void start(std::string path, std::function<void()> write, int64_t rank = 0);
  // The path of the save in flight, or nullopt.
  const std::optional<std::string>& in_flight() const { return path_; }
  // Waits for the save in flight, if any, and returns its path; a failed save throws
  // fulgur::Error(checkpoint) naming the checkpoint and why.
  std::optional<std::string> wait();
  // Waits for the save in flight, if any, and returns why it failed ("" when it succeeded or
  // none was in flight), without throwing: a multi-process run first agrees which ranks failed.
  std::string wait_for_failure();

 private:
  std::optional<std::string> path_;
  std::future<void> done_;
  int started_ = 0;  // saves started, for the test-only fault seam
};

}  // namespace fulgur
