// CPU and memory figures of this process and this machine, read from /proc (Linux).
#pragma once

#include <fulgur/types.h>

#include <chrono>
#include <cstdint>
#include <optional>

namespace fulgur::device_stats {

// Utilisation needs two readings: each call reports the share of time since the previous one.
class ProcSampler {
 public:
  // cpu_percent (all cores of the machine, 0-100), process_cpu_percent (100 = one core busy),
  // rss_mb, cpu_vm_percent (memory in use), cpu_swap_percent. Missing files leave keys out.
  void sample(MetricMap& out);

 private:
  struct CpuTimes {
    uint64_t busy = 0, total = 0;
  };
  static std::optional<CpuTimes> machine_cpu();
  static std::optional<double> process_cpu_seconds();

  std::optional<CpuTimes> last_machine_;
  std::optional<double> last_process_;
  std::chrono::steady_clock::time_point last_wall_;
};

}  // namespace fulgur::device_stats
