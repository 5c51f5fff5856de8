// Counts the floating-point operations of the ATen ops run while it is counting, with the same
// per-op formulas the PyTorch profiler uses for with_flops (matrix multiplications, conv2d,
// element-wise add and mul). Ops without a formula count zero, so the total is a lower bound.
#pragma once

#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <optional>

namespace fulgur::throughput {

class FlopCounter {
 public:
  FlopCounter() = default;
  ~FlopCounter() { stop(); }
  FlopCounter(const FlopCounter&) = delete;
  FlopCounter& operator=(const FlopCounter&) = delete;

  // Counts ops on this thread and on the autograd threads it starts (they inherit its callbacks).
  void start();
  // Stops counting; returns the FLOPs counted since start().
  uint64_t stop();
  bool counting() const { return handle_.has_value(); }

 private:
  std::optional<at::CallbackHandle> handle_;
};

}  // namespace fulgur::throughput
