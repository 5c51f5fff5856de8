#include "proc_stats.h"

#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

namespace fulgur::device_stats {

std::optional<ProcSampler::CpuTimes> ProcSampler::machine_cpu() {
  // First line of /proc/stat: "cpu user nice system idle iowait irq softirq steal ..." in ticks.
  std::ifstream in("/proc/stat");
  std::string label;
  if (!(in >> label) || label != "cpu") return std::nullopt;
  CpuTimes t;
  uint64_t value = 0;
  for (int field = 0; field < 8 && in >> value; ++field) {
    t.total += value;
    if (field != 3 && field != 4) t.busy += value;  // idle and iowait are not busy
  }
  return t;
}

std::optional<double> ProcSampler::process_cpu_seconds() {
  // /proc/self/stat: fields 14 and 15 are utime and stime in ticks; field 2 (comm) may hold spaces,
  // so parsing starts after its closing parenthesis.
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

void ProcSampler::sample(MetricMap& out) {
  const auto now = std::chrono::steady_clock::now();
  if (auto machine = machine_cpu()) {
    if (last_machine_ && machine->total > last_machine_->total)
      out["cpu_percent"] = 100.0 * static_cast<double>(machine->busy - last_machine_->busy) /
                           static_cast<double>(machine->total - last_machine_->total);
    last_machine_ = machine;
  }
  if (auto process = process_cpu_seconds()) {
    const double wall = std::chrono::duration<double>(now - last_wall_).count();
    if (last_process_ && wall > 0) out["process_cpu_percent"] = 100.0 * (*process - *last_process_) / wall;
    last_process_ = process;
  }
  last_wall_ = now;

  std::ifstream statm("/proc/self/statm");
  uint64_t pages_total = 0, pages_resident = 0;
  if (statm >> pages_total >> pages_resident)
    out["rss_mb"] = static_cast<double>(pages_resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);

  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kb = 0, mem_total = 0, mem_available = 0, swap_total = 0, swap_free = 0;
  while (meminfo >> key >> kb) {
    if (key == "MemTotal:") mem_total = kb;
    if (key == "MemAvailable:") mem_available = kb;
    if (key == "SwapTotal:") swap_total = kb;
    if (key == "SwapFree:") swap_free = kb;
    meminfo.ignore(64, '\n');
  }
  if (mem_total > 0) out["cpu_vm_percent"] = 100.0 * static_cast<double>(mem_total - mem_available) / mem_total;
  out["cpu_swap_percent"] = swap_total > 0 ? 100.0 * static_cast<double>(swap_total - swap_free) / swap_total : 0.0;
}

}  // namespace fulgur::device_stats
