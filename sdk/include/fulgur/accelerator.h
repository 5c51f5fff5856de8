// Accelerator: where tensors live and compute runs (cpu, cuda, ...).
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

// One training step recorded as a whole and launched again with the same buffers (CUDA graphs):
// the kernels are captured once, then each replay costs one launch instead of one per kernel.
// Made by Accelerator::make_step_graph; the Trainer drives it (`[trainer] cuda_graphs`).
class FULGUR_SDK_API StepGraph {
 public:
  virtual ~StepGraph();
  // Runs `step` eagerly on the stream the capture will use, so that lazy initialisation (library
  // handles, workspaces, optimizer state) happens before the capture, not inside it.
  virtual void warm_up(const std::function<void()>& step) = 0;
  // Runs `step` under stream capture: its kernels are recorded, none of them executes. Throws
  // fulgur::Error naming why when the step cannot be captured (a host synchronisation, a CPU
  // operation, an allocation the capture forbids); the graph then stays empty.
  virtual void capture(const std::function<void()>& step) = 0;
  // Launches the recorded step on the current stream (asynchronous, like the kernels it holds).
  virtual void replay() = 0;
};

class FULGUR_SDK_API Accelerator {
 public:
  virtual ~Accelerator();

  virtual c10::DeviceType device_type() const = 0;
  virtual bool is_available() const = 0;
  virtual int64_t device_count() const = 0;
  // Parses the Trainer's `devices` setting: "auto", "N" (count), "-1" (all), "0,2" (indices).
  // Throws fulgur::Error(config) naming the spec and what this accelerator offers.
  virtual std::vector<c10::Device> parse_devices(std::string_view spec) const = 0;
  // Makes `device` current for this process (cuda: set_device); called once before setup.
  virtual void setup_device(const c10::Device& device) = 0;
  // The c10d backend that fits this device type: "gloo" or "nccl".
  virtual std::string default_collective_backend() const = 0;
  // Waits for queued work on `device` (a no-op on cpu).
  virtual void synchronize(const c10::Device& device) = 0;
  // Point-in-time statistics for monitoring callbacks (memory, utilisation), keyed by metric name.
  virtual MetricMap device_stats(const c10::Device& device) const = 0;
  virtual void teardown() {}
  // The device's product name as its driver reports it ("NVIDIA H200"), for tables keyed by
  // hardware such as peak FLOP/s. Default: device.str().
  virtual std::string device_name(const c10::Device& device) const;
  // A StepGraph on `device`, or nullptr where this accelerator cannot capture steps (the default).
  virtual std::unique_ptr<StepGraph> make_step_graph(const c10::Device& device);
  // Overlapped batch copies (cuda: a side stream). The Trainer fetches the next training batch
  // before running the current step; where this returns true it has run `transfer` (the batch's
  // transfer hooks and copies to `device`) so that the copies overlap the steps already queued,
  // and the Trainer calls finish_transfer before the batch's step uses it. Default: false,
  // without calling `transfer` (the batch is transferred in line, at its step).
  virtual bool stage_transfer(const c10::Device& device, const std::function<void()>& transfer);
  // Makes the batch that stage_transfer copied safe to use on the current stream (it waits for the
  // copies; the memory is marked as used there).
  virtual void finish_transfer(const c10::Device& device, Batch& batch);
};

}  // namespace fulgur
