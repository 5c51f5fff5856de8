#include "flop_counter.h"

#include <torch/csrc/profiler/util.h>

#include <string>

namespace fulgur::throughput {

namespace {

// RecordFunction callbacks are plain function pointers: the running total lives here. One counter
// counts at a time (a second start() while one runs would be double counting anyway).
std::atomic<uint64_t> g_flops{0};

std::unique_ptr<at::ObserverContext> count_op(const at::RecordFunction& fn) {
  const auto args = torch::profiler::impl::saveExtraArgs(fn);
  if (!args.empty()) g_flops.fetch_add(torch::profiler::impl::computeFlops(fn.name(), args), std::memory_order_relaxed);
  return nullptr;
}

}  // namespace

void FlopCounter::start() {
  if (handle_) return;
  g_flops.store(0);
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&count_op).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
}

uint64_t FlopCounter::stop() {
  if (!handle_) return 0;
  at::removeCallback(*handle_);
  handle_.reset();
  return g_flops.exchange(0);
}

}  // namespace fulgur::throughput
