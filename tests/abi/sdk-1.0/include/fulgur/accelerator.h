/// @file
/// Accelerator: where tensors live and compute runs (cpu, cuda, ...), and the device services the
/// Trainer and strategies use (device selection, synchronisation, statistics, captured steps,
/// overlapped batch copies).
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// One training step recorded as a whole and launched again with the same buffers (CUDA graphs):
/// the kernels are captured once, then each replay costs one launch instead of one per kernel.
/// Made by StepGraphFactory::make_step_graph (an Accelerator extension); the Trainer owns it for one fit and drives it
/// (`[trainer] cuda_graphs`): warm_up for the first steps, capture once, then replay for every
/// later batch. Every call comes from the thread running the fit.
class FULGUR_SDK_API StepGraph {
 public:
  virtual ~StepGraph();
  /// Runs `step` eagerly on the stream the capture will use, so that lazy initialisation (library
  /// handles, workspaces, optimizer state) happens before the capture, not inside it. Called for
  /// each of the first few training steps (three, more while batches change shape). Exceptions
  /// from `step` propagate.
  virtual void warm_up(const std::function<void()>& step) = 0;
  /// Runs `step` under stream capture: its kernels are recorded, none of them executes. Called at
  /// most once per graph. Throws fulgur::Error naming why when the step cannot be captured (a
  /// host synchronisation, a CPU operation, an allocation the capture forbids); the graph then
  /// stays empty and the Trainer gives up capturing (cuda_graphs = "try") or fails ("on").
  virtual void capture(const std::function<void()>& step) = 0;
  /// Launches the recorded step on the current stream (asynchronous, like the kernels it holds).
  /// Called once per training batch after a successful capture, with the new batch copied into
  /// the recorded input buffers.
  virtual void replay() = 0;
};

/// The device kind a run trains on. Created when the Trainer is built and owned by it for its
/// whole life; the strategy reaches it through StrategyEnvironment::accelerator. Every method is
/// called from the thread that builds the Trainer or runs its stages, on every rank; none is a
/// collective.
class FULGUR_SDK_API Accelerator {
 public:
  virtual ~Accelerator();

  /// The c10 device type of every device this accelerator parses (CPU, CUDA, ...). Not called by
  /// the Trainer; the testing kit checks it against parse_devices.
  virtual c10::DeviceType device_type() const = 0;
  /// Whether this machine has a usable device of this kind. Asked once when the Trainer is built
  /// (an unavailable accelerator ends the run there, with parse_devices' message) and by
  /// accelerator = "auto" to pick the first available one. Must not throw.
  virtual bool is_available() const = 0;
  /// Devices of this kind visible to the process (0 when none). Not called by the Trainer; for
  /// parse_devices and the testing kit.
  virtual int64_t device_count() const = 0;
  /// Parses the Trainer's `devices` setting: "auto", "N" (count), "-1" (all), "0,2" (indices).
  /// Called once per process at the start of the first stage (under a launcher, a multi-process
  /// strategy's "auto" or "-1" arrives as the number of processes on this node), and when the
  /// Trainer is built if is_available() is false, to explain why. Throws fulgur::Error(config)
  /// naming the spec and what this accelerator offers.
  virtual std::vector<c10::Device> parse_devices(std::string_view spec) const = 0;
  /// Makes `device` current for this process (cuda: set_device, plus the accelerator's own
  /// settings). Called by the strategy from Strategy::setup_environment, once per process, before
  /// the model is touched. Throws fulgur::Error(config) when the device does not exist.
  virtual void setup_device(const c10::Device& device) = 0;
  /// The c10d backend that fits this device type: "gloo" or "nccl". Asked by multi-process
  /// strategies whose `backend` option is "auto", in setup_environment.
  virtual std::string default_collective_backend() const = 0;
  /// Blocks the calling thread until queued work on `device` has finished (a no-op on cpu).
  /// Reached through TrainerContext::synchronize_device (timing callbacks), any number of times.
  virtual void synchronize(const c10::Device& device) = 0;
  /// Point-in-time statistics for monitoring callbacks (memory, utilisation), keyed by metric
  /// name, every value finite. Reached through TrainerContext::device_stats, possibly every batch:
  /// keep it cheap.
  virtual MetricMap device_stats(const c10::Device& device) const = 0;
  /// Releases what setup_device took. Called by the strategy from Strategy::teardown (the built-in
  /// strategies do), once, when the Trainer is destroyed; must not throw. Default: nothing.
  virtual void teardown() {}
  /// The device's product name as its driver reports it ("NVIDIA H200"), for tables keyed by
  /// hardware such as peak FLOP/s. Reached through TrainerContext::device_name. Default:
  /// device.str().
  virtual std::string device_name(const c10::Device& device) const;
  /// The extension interface named `id` that this accelerator implements (StepGraphFactory,
  /// StagedTransfers, ...), or nullptr. Implement it with fulgur::WithExtensions; see
  /// fulgur/extension.h. Must not throw.
  virtual void* extension(std::string_view id) noexcept;
};

/// Extension (SDK 1.0) of an Accelerator that can record a training step as a StepGraph (CUDA
/// graphs). Without it, `[trainer] cuda_graphs = "on"` is refused with the accelerator's name.
class StepGraphFactory {
 public:
  /// The extension's id for Accelerator::extension().
  static constexpr std::string_view kExtensionId = "fulgur.accelerator.step_graph/1";
  /// A StepGraph on `device`, owned by the caller, or nullptr where this device cannot capture
  /// steps. Asked once per fit, at its start, when `[trainer] cuda_graphs` is not "off" and nothing
  /// else refused capturing.
  virtual std::unique_ptr<StepGraph> make_step_graph(const c10::Device& device) = 0;

 protected:
  ~StepGraphFactory() = default;
};

/// Extension (SDK 1.0) of an Accelerator that copies the next training batch while the current
/// step runs (cuda: a side stream). Without it, each batch is transferred in line, at its step.
class StagedTransfers {
 public:
  /// The extension's id for Accelerator::extension().
  static constexpr std::string_view kExtensionId = "fulgur.accelerator.staged_transfers/1";
  /// The Trainer fetches the next training batch before running the current step; once that step
  /// is queued (and any validation after it has run) it calls this with the next batch. Where this
  /// returns true it has run `transfer` (the batch's transfer hooks and copies to `device`) so that
  /// the copies overlap the steps already queued, and the Trainer calls finish_transfer before the
  /// batch's step uses it. Called for every training batch of an epoch but the first. Returning
  /// false without calling `transfer` leaves the batch to be transferred in line. Exceptions from
  /// `transfer` must propagate.
  virtual bool stage_transfer(const c10::Device& device, const std::function<void()>& transfer) = 0;
  /// Makes the batch that stage_transfer copied safe to use on the current stream (it waits for the
  /// copies; the memory is marked as used there). Called once for each batch stage_transfer
  /// accepted, right before its step.
  virtual void finish_transfer(const c10::Device& device, Batch& batch) = 0;

 protected:
  ~StagedTransfers() = default;
};

}  // namespace fulgur
