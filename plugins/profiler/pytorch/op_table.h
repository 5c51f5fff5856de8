// The profiler's summary: operators (ATen ops and Fulgur's action scopes) aggregated over the
// recorded events, ranked by self CPU time, as a text table.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::autograd::profiler {
struct KinetoEvent;
}

namespace fulgur::pytorch_profiler {

struct OpStats {
  int64_t calls = 0;
  uint64_t self_ns = 0;    // host time not spent in a nested event
  uint64_t total_ns = 0;   // host time including nested events
  uint64_t device_ns = 0;  // kernels run on an accelerator under this name
};

class OpTable {
 public:
  // Adds one recorded cycle's events.
  void add(const std::vector<torch::autograd::profiler::KinetoEvent>& events);
  bool empty() const { return ops_.empty(); }
  void clear() { ops_.clear(); }
  const std::map<std::string, OpStats>& ops() const { return ops_; }
  // The top `row_limit` operators by self CPU time.
  std::string render(const std::string& title, int64_t row_limit) const;

 private:
  std::map<std::string, OpStats> ops_;
};

}  // namespace fulgur::pytorch_profiler
