// Built-in accelerator `cpu`: the host's processors, one "device".
#include <fulgur/plugin.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <sys/resource.h>
#include <unistd.h>
#include <fstream>
#include <string>

namespace {

class CpuAccelerator final : public fulgur::Accelerator {
 public:
  FULGUR_OPTIONS(Options, (integer, threads, "Intra-op threads per process; 0 keeps libtorch's default", 0));
  explicit CpuAccelerator(const Options& options) : threads_(options.threads) {}

  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }
  bool is_available() const override { return true; }
  int64_t device_count() const override { return 1; }

  std::vector<c10::Device> parse_devices(std::string_view spec) const override {
    // CPU processes are data-parallel replicas of the one host "device": `devices = N` means N
    // processes, each on the CPU, as in Lightning.
    std::string s(spec);
    if (s == "auto" || s == "-1" || s.empty()) return {c10::Device(c10::DeviceType::CPU)};
    try {
      size_t used = 0;
      long n = std::stol(s, &used);
      if (used == s.size() && n >= 1)
        return std::vector<c10::Device>(static_cast<size_t>(n), c10::Device(c10::DeviceType::CPU));
    } catch (const std::exception&) {
    }
    throw fulgur::Error(fulgur::ErrorKind::config,
                        fmt::format("accelerator 'cpu': devices = \"{}\" is not understood; use a process count "
                                    "such as 1 or 2, or \"auto\"",
                                    s));
  }

  void setup_device(const c10::Device&) override {
    if (threads_ > 0) at::set_num_threads(static_cast<int>(threads_));
  }
  std::string default_collective_backend() const override { return "gloo"; }
  void synchronize(const c10::Device&) override {}

  fulgur::MetricMap device_stats(const c10::Device&) const override {
    fulgur::MetricMap stats;
    rusage usage{};
    if (getrusage(RUSAGE_SELF, &usage) == 0) {
      stats["cpu_user_seconds"] = usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6;
      stats["cpu_system_seconds"] = usage.ru_stime.tv_sec + usage.ru_stime.tv_usec / 1e6;
      stats["peak_rss_mb"] = usage.ru_maxrss / 1024.0;
    }
    std::ifstream statm("/proc/self/statm");
    long pages_total = 0, pages_resident = 0;
    if (statm >> pages_total >> pages_resident)
      stats["rss_mb"] =
          static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
    stats["num_threads"] = at::get_num_threads();
    return stats;
  }

 private:
  int64_t threads_;
};

}  // namespace

FULGUR_PLUGIN(CpuAccelerator, "cpu", "0.1.0", "The host CPU (intra-op threads from libtorch)")
