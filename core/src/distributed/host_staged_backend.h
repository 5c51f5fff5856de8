// Internal: a c10d backend for tensors of a device type that the wrapped backend cannot move (Gloo
// moves CPU and CUDA tensors only; a plugin device's tensors, XPU, ... reach it here).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fulgur::detail {

/// Wraps `host` (a backend that moves CPU tensors): each collective copies its device tensors to
/// host memory, runs there, and copies the results back before it returns (its Work is complete,
/// with a completed future, which is what c10d's Reducer reads the reduced bucket from). Covers
/// what the engine and c10d's Reducer use: broadcast, all-reduce (and coalesced), reduce,
/// all-gather (list, base, coalesced), reduce-scatter (list, base, coalesced) and barrier.
c10::intrusive_ptr<c10d::Backend> make_host_staged_backend(c10::intrusive_ptr<c10d::Backend> host);

}  // namespace fulgur::detail
