// Built-in accelerator `cuda`: NVIDIA GPUs through libtorch's CUDA runtime (c10/cuda), one process
// per device. Device selection follows Lightning's CUDAAccelerator (cuda_devices.h); the indices are
// those the process sees, so CUDA_VISIBLE_DEVICES applies through the runtime. Options act at
// setup_device: `benchmark` (cuDNN autotuning) and `float32_matmul_precision` (TF32). Captured
// training steps (`[trainer] cuda_graphs`) are at::cuda::CUDAGraph recordings on a side stream.
#include <fulgur/plugin.h>

#include <ATen/Context.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "cuda_devices.h"

namespace {

namespace cuda = fulgur::cuda_accelerator;

// ATen resolves its CUDA hooks once per process, at the first device query. A query made before
// this plugin loaded libtorch_cuda (a torch::manual_seed, a torch::cuda::is_available()) fixes the
// CPU-only stub for good: CUDA generators are never seeded and device calls fail far from the
// cause. With the real hooks the runtime version answers even without a device.
void require_real_cuda_hooks() {
  try {
    (void)at::detail::getCUDAHooks().versionCUDART();
  } catch (const std::exception&) {
    throw fulgur::Error(
        fulgur::ErrorKind::config,
        "accelerator 'cuda': ATen's CUDA hooks were resolved before libtorch_cuda was loaded, so CUDA is off for "
        "this whole process (something queried a device, e.g. torch::manual_seed or torch::cuda::is_available(), "
        "before the Trainer loaded the cuda accelerator); build the Trainer before seeding or querying devices, or "
        "link the program against libtorch_cuda");
  }
}

// A training step as one CUDA graph. Warm-up and capture run on one side stream (a capture cannot
// use the default stream, and lazy initialisation such as cuBLAS workspaces is per stream); the
// side stream waits for the current one before and the current one for it after, so the step
// stays ordered with the batch copies and the work that follows it. Replays run on the current
// stream. Thread-local capture mode: the data loader's threads may still pin host memory.
class CudaStepGraph final : public fulgur::StepGraph {
 public:
  explicit CudaStepGraph(c10::DeviceIndex index)
      : index_(index), stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}

  void warm_up(const std::function<void()>& step) override { on_side_stream(step); }

  void capture(const std::function<void()>& step) override {
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    // Our own pool id, so that a failed capture can release what capture_begin set up (the
    // graph only does that after a successful capture_end), and the default generator's state,
    // which capture_begin marks as capturing until capture_end.
    const auto pool = at::cuda::graph_pool_handle();
    at::Generator generator = at::cuda::detail::getDefaultCUDAGenerator(index_);
    at::Generator before;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      before = generator.clone();
    }
    bool begun = false;
    try {
      on_side_stream([&] {
        graph_->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
        begun = true;
        step();
        graph_->capture_end();
        begun = false;
      });
    } catch (const std::exception& e) {
      if (begun) abandon_capture(pool, generator, before);
      graph_.reset();
      (void)cudaGetLastError();  // a refused capture leaves no error behind for the next kernel
      // CUDA errors carry advice lines (CUDA_LAUNCH_BLOCKING, ...) after the cause: keep the cause.
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      const std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
      throw fulgur::Error(fulgur::ErrorKind::runtime, text.substr(0, text.find('\n')));
    }
  }

  void replay() override { graph_->replay(); }

 private:
  // Runs `fn` on the side stream, ordered after the work queued on the current stream and before
  // the work queued there afterwards, also when `fn` throws (the current stream must not reuse
  // memory the side stream may still read).
  template <class Fn>
  void on_side_stream(Fn&& fn) {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(index_);
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(stream_);
    struct Rejoin {
      c10::cuda::CUDAStream side, current;
      ~Rejoin() {
        at::cuda::CUDAEvent done;
        done.record(side);
        done.block(current);
      }
    } rejoin{stream_, current};
    c10::cuda::CUDAStreamGuard guard(stream_);
    fn();
  }

  // The capture failed between capture_begin and capture_end: ends the stream's capture (the
  // recording is dropped), then undoes what capture_begin set up and only a successful
  // capture_end undoes: the caching allocators' routing of this stream's allocations into the
  // graph's pool (else they would stay in "capture underway" mode and never reuse freed blocks),
  // the pool itself, and the generator's capturing flag (else the next random op outside a graph
  // fails). Each step is best effort: this runs while an error is already on its way.
  void abandon_capture(const decltype(at::cuda::graph_pool_handle())& pool, at::Generator& generator,
                       const at::Generator& before) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
      cudaGraph_t partial = nullptr;
      (void)cudaStreamEndCapture(stream_.stream(), &partial);
      if (partial) (void)cudaGraphDestroy(partial);
    }
    (void)cudaGetLastError();
    auto quietly = [](auto&& fn) {
      try {
        fn();
      } catch (...) {
      }
    };
    quietly([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(index_, pool); });
    quietly([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool); });
    quietly([&] {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.graphsafe_set_state(before);
    });
    graph_.reset();  // unregisters from the generator; releases no pool (capture_end never ran)
    quietly([&] { c10::cuda::CUDACachingAllocator::releasePool(index_, pool); });
    quietly([&] { at::getHostAllocator(at::kCUDA)->release_pool(pool); });
  }

  c10::DeviceIndex index_;
  c10::cuda::CUDAStream stream_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
};

class CudaAccelerator final
    : public fulgur::WithExtensions<fulgur::Accelerator, fulgur::StepGraphFactory, fulgur::StagedTransfers> {
 public:
  FULGUR_OPTIONS(Options, (boolean, benchmark, "cuDNN benchmark mode (torch.backends.cudnn.benchmark)", false),
                 (string, float32_matmul_precision,
                  "torch.set_float32_matmul_precision: \"highest\", \"high\" (TF32) or \"medium\"", "highest"));
  explicit CudaAccelerator(const Options& options)
      : benchmark_(options.benchmark), matmul_precision_(options.float32_matmul_precision) {
    options.check(matmul_precision_ == "highest" || matmul_precision_ == "high" || matmul_precision_ == "medium",
                  "float32_matmul_precision",
                  "is not a precision; use \"highest\" (full fp32), \"high\" (TF32) or \"medium\" (bf16 passes)");
  }

  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }
  // device_count() asks the driver once (c10 caches it) and returns 0 without a driver or device.
  bool is_available() const override {
    if (device_count() <= 0) return false;
    require_real_cuda_hooks();  // a GPU this process could not use: refuse rather than fall back to cpu
    return true;
  }
  int64_t device_count() const override { return static_cast<int64_t>(c10::cuda::device_count()); }

  std::vector<c10::Device> parse_devices(std::string_view spec) const override {
    require_real_cuda_hooks();  // the first thing a run asks of this accelerator
    std::vector<c10::Device> devices;
    for (int64_t index : cuda::parse_cuda_devices(spec, device_count(), std::getenv("CUDA_VISIBLE_DEVICES")))
      devices.emplace_back(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
    return devices;
  }

  void setup_device(const c10::Device& device) override {
    require_real_cuda_hooks();
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

  std::string device_name(const c10::Device& device) const override {
    if (!device.is_cuda() || device_count() <= 0) return device.str();
    return at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->name;
  }

  // The next batch's copies on a stream of their own: they overlap the step queued before them on
  // the current stream (pinned batches copy asynchronously). The Trainer stages one batch at a
  // time, so one event orders it: finish_transfer makes the current stream wait for it and marks
  // the batch's memory as used there (it was allocated on the copy stream).
  bool stage_transfer(const c10::Device& device, const std::function<void()>& transfer) override {
    if (!device.is_cuda() || device_count() <= 0) return false;
    const c10::DeviceIndex index = device.index() < 0 ? c10::cuda::current_device() : device.index();
    if (!copy_stream_ || copy_stream_->device_index() != index)
      copy_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    {
      c10::cuda::CUDAStreamGuard guard(*copy_stream_);
      transfer();
    }
    copied_.record(*copy_stream_);
    return true;
  }

  void finish_transfer(const c10::Device& device, fulgur::Batch& batch) override {
    if (!copy_stream_) return;
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(copy_stream_->device_index());
    copied_.block(current);
    auto used_here = [&](at::Tensor& t) {
      if (t.defined() && t.is_cuda()) t.record_stream(current);
    };
    used_here(batch.input);
    used_here(batch.target);
    for (at::Tensor& t : batch.extra) used_here(t);
    (void)device;
  }

  std::unique_ptr<fulgur::StepGraph> make_step_graph(const c10::Device& device) override {
    if (!device.is_cuda() || device_count() <= 0) return nullptr;
    return std::make_unique<CudaStepGraph>(device.index() < 0 ? c10::cuda::current_device() : device.index());
  }

 private:
  bool benchmark_;
  std::string matmul_precision_;
  std::optional<c10::cuda::CUDAStream> copy_stream_;
  at::cuda::CUDAEvent copied_;
};

}  // namespace

FULGUR_PLUGIN(CudaAccelerator, "cuda", "0.1.0", "NVIDIA GPUs through libtorch's CUDA runtime (one process per device)")
