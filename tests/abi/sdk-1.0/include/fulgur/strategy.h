/// @file
/// Strategy: how training is spread over processes and devices (single_device, ddp, fsdp, ...).
/// The strategy owns the model's and the optimizers' state: it builds the model (configure_model),
/// places or shards it, may wrap or replace the optimizers, decides clipping and the optimizer step
/// (so a sharded strategy can use a global norm and a rank-agreed skip), produces and restores the
/// state dicts, and writes and reads checkpoints in parts (so it can gather them, or write and read
/// one shard per rank). The defaults are what a replicated strategy does (fulgur/state_dict.h).
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

class Accelerator;
class Communicator;
struct CommunicatorOptions;
class Precision;

/// What Strategy::setup_environment gets: the devices, where this process sits, and the door to
/// the process group. Valid during that call; the pointer and the function stay valid for the
/// Trainer's life, so a strategy may keep them.
struct StrategyEnvironment {
  /// The run's accelerator, owned by the Trainer and destroyed after the strategy.
  Accelerator* accelerator = nullptr;
  std::vector<c10::Device> devices;  ///< what the accelerator parsed from `devices` (never empty)
  ClusterInfo cluster;               ///< from the detected cluster environment (torchrun, SLURM, MPI, ...)
  /// Joins this process to the job's process group (c10d: TCPStore rendezvous at
  /// cluster.master_addr:master_port, then Gloo or NCCL). A collective: every rank calls it once,
  /// from setup_environment. Blocks until every rank has joined or options.timeout passes; throws
  /// fulgur::Error(distributed) saying why (port in use, timeout). The strategy owns the returned
  /// Communicator (the Trainer keeps only a weak reference); destroying it leaves the group.
  std::function<std::shared_ptr<Communicator>(const CommunicatorOptions&)> connect;
};

/// A checkpoint as the Trainer hands it to the strategy, and gets it back: the model and optimizer
/// state as this rank's strategy produced them (full tensors, or this rank's shards), and the rest.
/// The pointers refer to the Trainer's storage (IValue stays forward-declared in SDK headers) and
/// are valid only during the call that receives them.
struct CheckpointParts {
  /// Model state: what module_state_dict() returned (a dict of name -> tensor by default).
  c10::IValue* model_state = nullptr;
  /// One entry per optimizer: what optimizer_state_dict() returned; empty for weights-only.
  std::vector<c10::IValue>* optimizer_states = nullptr;
  /// Every other top-level key (epoch, global_step, loops, callbacks, lr_schedulers, ...): a dict.
  c10::IValue* metadata = nullptr;
};

/// What the Trainer hands to configure_model: the Module's configure_model, and what the Trainer
/// does to the whole model between configure_model and setup_module (move it to root_device(), then
/// the precision plugin's convert_module), applicable to one part of it. A sharded strategy
/// prepares and shards each block as the Module builds it (fulgur::built_block), so that no rank
/// ever holds the whole model; the Trainer's later pass over the whole model finds those blocks
/// done. Both functions refer to the Trainer's stack: call them only during configure_model.
struct ModelBuild {
  /// Runs the Module's configure_model (attributed to the Module when it throws). Call it once.
  std::function<void()> configure;
  std::function<void(torch::nn::Module&)> prepare;  ///< device, then precision, for one block
};

/// How training is spread over processes and devices. Created when the Trainer is built and owned
/// by it; one per Trainer, for all its stages. Every method is called on every rank, from the
/// thread that runs the Trainer's stages; methods marked as collectives must be entered by every
/// rank in the same order (a rank that skips one leaves the others waiting until the timeout).
/// What a method throws ends the stage (on_exception, teardown hooks) and reaches the caller of
/// fit/validate/test/predict.
class FULGUR_SDK_API Strategy {
 public:
  virtual ~Strategy();

  /// True when every device needs a process of its own (ddp). With `devices = N` and no launcher
  /// detected (torchrun, SLURM, MPI), the Trainer then starts N-1 more copies of the program.
  /// Asked once, at the start of the first stage, before setup_environment.
  virtual bool launches_processes() const { return false; }

  /// Takes the devices and joins the process group (through environment.connect). Called once per
  /// Trainer, at the start of its first stage, before any hook and before anything touches the
  /// model; a multi-process strategy makes it a collective. Throws fulgur::Error(config) for a
  /// device selection it cannot run (and fails the stage); teardown() is then never called.
  virtual void setup_environment(const StrategyEnvironment& environment) = 0;
  /// The device this process trains on. Valid after setup_environment; asked often: return a
  /// stored value.
  virtual c10::Device root_device() const = 0;
  /// Where this process sits in the job. Valid after setup_environment; asked often (the returned
  /// reference must stay valid for the strategy's life).
  virtual const ClusterInfo& cluster() const = 0;
  /// Whether this is global rank zero (the process that writes files and logs).
  bool is_global_zero() const { return cluster().global_rank == 0; }

  /// Runs the Module's configure_model (build.configure), where layers may be created. Blocks the
  /// Module marks with fulgur::built_block while it builds reach this strategy's BlockHooks (if it
  /// installed some), where build.prepare puts a block where setup_module expects it, and a sharded
  /// strategy keeps only its shards. Called at the start of every stage (fit, validate, test,
  /// predict), after the callbacks' setup hooks, before setup_module. Default: build.configure().
  virtual void configure_model(torch::nn::Module& module, const ModelBuild& build);
  /// Moves/wraps/shards the model and hooks gradient synchronization. Called at the start of every
  /// stage, after the precision plugin's convert_module (the parameters are in their training
  /// dtype, on root_device()) and before the Module's configure_optimizers, so optimizers are
  /// created over the parameters this returns to.
  virtual void setup_module(torch::nn::Module& module) = 0;
  /// Sees the optimizers configure_optimizers returned, and may wrap or replace entries (a
  /// replacement must keep param_groups() in the same order: LR schedulers and checkpoints
  /// address groups by index). Called at the start of fit only, after setup_module. Changing the
  /// number of entries is an error. Default: keeps them.
  virtual void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers);

  /// Before each training batch's training_step (after on_train_batch_start); `sync_gradients` as
  /// for backward() below. Default: nothing.
  virtual void before_training_step(bool /*sync_gradients*/) {}
  /// Backward of `loss` through the precision plugin's scaling (typically
  /// `precision.scale_loss(loss).backward()`). Called once per training batch whose step returned
  /// a loss (after on_before_backward), and for each manual_backward under manual optimization.
  /// `sync_gradients` is false on gradient-accumulation micro-steps so that data-parallel
  /// strategies skip communication; true on the last micro-step of a window and under manual
  /// optimization.
  virtual void backward(const at::Tensor& loss, Precision& precision, bool sync_gradients) = 0;
  /// Clips the (unscaled) gradients of `optimizer`; a sharded strategy clips by the global norm
  /// across shards (then a collective). Called once per optimizer step when `[trainer]
  /// gradient_clip_val` > 0 (after on_before_optimizer_step), and when the Module calls
  /// clip_gradients. Default: the precision plugin clips the local gradients.
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, Precision& precision, double clip_value,
                              GradClipAlgorithm algorithm);
  /// Steps through the precision plugin (which skips on inf/NaN gradients); returns whether the
  /// step was taken. A sharded strategy agrees the skip across ranks. Called once per optimizer
  /// step (the last batch of an accumulation window, or each optimizer.step() under manual
  /// optimization), after the precision unscaled the gradients and the before_optimizer_step
  /// hooks ran; not called for a step the Trainer takes itself (DeviceStepStrategy::delegates_optimizer_step).
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, Precision& precision) = 0;
  /// `tensor` reduced elementwise over all ranks with `op`. A collective. The input is not
  /// modified; with one process the result may be `tensor` itself. Used for synchronised metrics
  /// (sync_dist) at epoch ends and by TrainerContext::reduce.
  virtual at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  /// Every rank's `tensor` (the same shape on every rank), in rank order. A collective.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  /// Overwrites `tensor` on every rank with rank `src`'s (same shape and dtype everywhere). A
  /// collective.
  virtual void broadcast(at::Tensor& tensor, int64_t src) = 0;
  /// Rank `src`'s `value`, returned on every rank. A collective. Used for the run's log directory
  /// and checkpoint paths, and by TrainerContext::broadcast.
  virtual std::string broadcast_string(const std::string& value, int64_t src) = 0;
  /// Returns when every rank has arrived; `name` says where, for messages. A collective. The
  /// Trainer calls it after prepare_data at every stage start.
  virtual void barrier(std::string_view name) = 0;
  /// Agreement across ranks: all ranks true (all=true) or any rank true (all=false); the same
  /// answer on every rank. A collective; possibly once per training batch (max_time, loaders of
  /// unknown length with several ranks): keep it to one small all-reduce.
  virtual bool reduce_boolean_decision(bool decision, bool all) = 0;

  /// Which slice of the data this process reads (0 .. data_parallel_size() - 1). Asked whenever
  /// the Trainer sets up a stage's loaders.
  virtual int64_t data_parallel_rank() const = 0;
  /// Into how many slices the data is split (1 when every process reads all of it).
  virtual int64_t data_parallel_size() const = 0;

  // ---- state and checkpoints -------------------------------------------------------------------

  /// The model's state as checkpoints store it. Called on every rank for every checkpoint saved
  /// (a collective where the strategy gathers shards). Default: every parameter and buffer by its
  /// dotted Python name (a GenericDict str -> Tensor), detached, not copied.
  virtual c10::IValue module_state_dict(torch::nn::Module& module);
  /// Restores what module_state_dict produced (or a Python/Lightning state_dict). Called on every
  /// rank when a stage starts from a checkpoint (ckpt_path), after setup_module. With `strict`,
  /// missing, unexpected and mis-shaped keys throw fulgur::Error(checkpoint) naming `origin`.
  virtual void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                                      const std::string& origin);
  /// One optimizer's state, in torch.optim's state_dict layout where the optimizer is known.
  /// Called on every rank for every full (not weights-only) checkpoint, once per optimizer.
  virtual c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer);
  /// Restores what optimizer_state_dict produced into `optimizer`. Called on every rank when fit
  /// resumes from a checkpoint, after on_fit_start. Throws fulgur::Error(checkpoint) naming
  /// `origin` when the state does not fit the optimizer.
  virtual void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                         const std::string& origin);
  /// Writes a checkpoint at `path`. A collective: every rank calls it with its own parts, whenever
  /// a checkpoint is saved (TrainerContext::save_checkpoint, a signal). Returns once the checkpoint
  /// is complete on disk. Default: rank zero joins the parts into one Lightning-layout dict and
  /// writes one file atomically (fulgur/checkpoint_io.h), creating missing directories; the others
  /// wait at a barrier. Throws fulgur::Error (io, checkpoint) when it cannot be written.
  virtual void save_checkpoint(const CheckpointParts& parts, const std::string& path);
  /// Reads what save_checkpoint wrote (or a PyTorch/Lightning file, or a DCP directory) into `out`:
  /// the model state, the optimizer states (left empty for a weights-only checkpoint) and the
  /// other keys. Called on every rank when a stage starts from a checkpoint. A missing, corrupt or
  /// foreign checkpoint throws fulgur::Error(checkpoint) naming the path.
  virtual void load_checkpoint(const std::string& path, const CheckpointParts& out);
  /// Whether `path` holds a checkpoint this strategy can read (a file, or a sharded directory).
  /// Asked on every rank for an explicit ckpt_path, before load_checkpoint.
  virtual bool is_checkpoint(const std::string& path) const;

  /// Releases what setup_environment took (the process group, the device: the built-in
  /// strategies call Accelerator::teardown here). Called once, when the Trainer is destroyed, and
  /// only if setup_environment succeeded. Must not throw (the Trainer logs what it throws as a
  /// warning). Default: nothing.
  virtual void teardown() {}
  /// The extension interface named `id` that this strategy implements (DeviceStepStrategy, ...),
  /// or nullptr. Implement it with fulgur::WithExtensions; see fulgur/extension.h. Must not throw.
  virtual void* extension(std::string_view id) noexcept;
};

/// Extension (SDK 1.0) of a Strategy whose training step may take the Trainer's faster paths:
/// recorded as a StepGraph (CUDA graphs) and stepped with fused kernels that read a flag the
/// precision computed on the device. Without it, neither path is taken.
class DeviceStepStrategy {
 public:
  /// The extension's id for Strategy::extension().
  static constexpr std::string_view kExtensionId = "fulgur.strategy.device_step/1";
  /// Why a training step under this strategy cannot be recorded as a StepGraph (communication
  /// decided on the host, hooks that run per step), or "" when backward() and clip_gradients()
  /// only queue device work and the optimizer may be stepped on its own parameters by the
  /// Trainer's capturable step. Asked at the start of fit when `[trainer] cuda_graphs` is not
  /// "off". A strategy without this extension is refused, so a plugin opts in knowingly.
  virtual std::string step_capture_refusal() const = 0;
  /// Whether optimizer_step does nothing but precision.optimizer_step(optimizer) (no agreement
  /// across ranks, no shards to refresh after the step): the Trainer may then take a step that the
  /// precision decides on the device (DeviceStepPrecision::device_found_inf) without calling optimizer_step.
  /// Asked at the start of fit and at each optimizer step. Without this extension: false.
  virtual bool delegates_optimizer_step() const = 0;

 protected:
  ~DeviceStepStrategy() = default;
};

}  // namespace fulgur
