// Built-in accelerator `cuda`: NVIDIA GPUs through libtorch's CUDA runtime (c10/cuda), one process
// per device. Device selection follows Lightning's CUDAAccelerator (cuda_devices.h); the indices are
// those the process sees, so CUDA_VISIBLE_DEVICES applies through the runtime. Options act at
// setup_device: `benchmark` (cuDNN autotuning) and `float32_matmul_precision` (TF32).
#include <fulgur/plugin.h>

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "cuda_devices.h"

namespace {

namespace cuda = fulgur::cuda_accelerator;

std::string checked_precision(const std::string& value) {
  if (value == "highest" || value == "high" || value == "medium") return value;
  throw fulgur::Error(fulgur::ErrorKind::config,
                      fmt::format("accelerator 'cuda': float32_matmul_precision = \"{}\" is not a precision; use "
                                  "\"highest\" (full fp32), \"high\" (TF32) or \"medium\" (bf16 passes)",
                                  value));
}

class CudaAccelerator final : public fulgur::Accelerator {
 public:
  explicit CudaAccelerator(const fulgur::Options& options)
      : benchmark_(options.get_bool("benchmark")),
        matmul_precision_(checked_precision(options.get_string("float32_matmul_precision"))) {}

  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }
  // device_count() asks the driver once (c10 caches it) and returns 0 without a driver or device.
  bool is_available() const override { return device_count() > 0; }
  int64_t device_count() const override { return static_cast<int64_t>(c10::cuda::device_count()); }

  std::vector<c10::Device> parse_devices(std::string_view spec) const override {
    std::vector<c10::Device> devices;
    for (int64_t index : cuda::parse_cuda_devices(spec, device_count(), std::getenv("CUDA_VISIBLE_DEVICES")))
      devices.emplace_back(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
    return devices;
  }

  void setup_device(const c10::Device& device) override {
    const int64_t count = device_count();
    if (count <= 0)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          cuda::no_device_message(count, std::getenv("CUDA_VISIBLE_DEVICES")));
    if (!device.is_cuda() || device.index() >= count)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("accelerator 'cuda': cannot set up device {}: {} CUDA device(s) visible "
                                      "(indices 0..{}); check devices and CUDA_VISIBLE_DEVICES",
                                      device.str(), count, count - 1));
    // Before anything allocates: the caching allocator and NCCL use the current device.
    c10::cuda::set_device(device.index() < 0 ? 0 : device.index());
    at::globalContext().setBenchmarkCuDNN(benchmark_);
    at::globalContext().setFloat32MatmulPrecision(matmul_precision_);
  }

  std::string default_collective_backend() const override { return "nccl"; }

  void synchronize(const c10::Device& device) override {
    if (device.is_cuda() && device_count() > 0) c10::cuda::device_synchronize();
  }

  // The caching allocator's counters (host-side: no synchronization) under the keys
  // torch.cuda.memory_stats() uses for the aggregate pool, which Lightning's CUDAAccelerator
  // returns from get_device_stats; the device_stats callback logs them per device.
  fulgur::MetricMap device_stats(const c10::Device& device) const override {
    fulgur::MetricMap out;
    if (!device.is_cuda() || device_count() <= 0) return out;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    auto put = [&](const char* name, const c10::CachingAllocator::StatArray& stat) {
      out[fmt::format("{}.all.current", name)] = static_cast<double>(stat[all].current);
      out[fmt::format("{}.all.peak", name)] = static_cast<double>(stat[all].peak);
    };
    put("allocated_bytes", stats.allocated_bytes);
    put("reserved_bytes", stats.reserved_bytes);
    put("active_bytes", stats.active_bytes);
    out["num_alloc_retries"] = static_cast<double>(stats.num_alloc_retries);
    out["num_ooms"] = static_cast<double>(stats.num_ooms);
    return out;
  }

 private:
  bool benchmark_;
  std::string matmul_precision_;
};

}  // namespace

FULGUR_PLUGIN(CudaAccelerator, "cuda", "0.1.0", "NVIDIA GPUs through libtorch's CUDA runtime (one process per device)",
              FULGUR_OPTION(boolean, benchmark, "cuDNN benchmark mode (torch.backends.cudnn.benchmark)", false),
              FULGUR_OPTION(string, float32_matmul_precision,
                            "torch.set_float32_matmul_precision: \"highest\", \"high\" (TF32) or \"medium\"",
                            "highest"))
