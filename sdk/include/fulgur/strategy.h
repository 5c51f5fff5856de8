// Strategy: how training is spread over processes and devices (single_device, ddp, fsdp, ...).
//
// The strategy owns the model's and the optimizers' state: it builds the model (configure_model),
// places or shards it, may wrap or replace the optimizers, decides clipping and the optimizer step
// (so a sharded strategy can use a global norm and a rank-agreed skip), produces and restores the
// state dicts, and writes and reads checkpoints in parts (so it can gather them, or write and read
// one shard per rank). The defaults are what a replicated strategy does (fulgur/state_dict.h).
#pragma once

#include <fulgur/export.h>
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

struct StrategyEnvironment {
  Accelerator* accelerator = nullptr;
  std::vector<c10::Device> devices;  // what the accelerator parsed from `devices`
  ClusterInfo cluster;               // from the detected cluster environment (torchrun, SLURM, MPI, ...)
  // Joins this process to the job's process group (c10d: TCPStore rendezvous at
  // cluster.master_addr:master_port, then Gloo or NCCL). Blocks until every rank has joined or
  // options.timeout passes; throws fulgur::Error(distributed) saying why (port in use, timeout).
  std::function<std::shared_ptr<Communicator>(const CommunicatorOptions&)> connect;
};

// A checkpoint as the Trainer hands it to the strategy, and gets it back: the model and optimizer
// state as this rank's strategy produced them (full tensors, or this rank's shards), and the rest.
// The pointers refer to the Trainer's storage (IValue stays forward-declared in SDK headers).
struct CheckpointParts {
  // Model state: what module_state_dict() returned (a dict of name -> tensor by default).
  c10::IValue* model_state = nullptr;
  // One entry per optimizer: what optimizer_state_dict() returned; empty for weights-only.
  std::vector<c10::IValue>* optimizer_states = nullptr;
  // Every other top-level key (epoch, global_step, loops, callbacks, lr_schedulers, ...): a dict.
  c10::IValue* metadata = nullptr;
};

// What the Trainer hands to configure_model: the Module's configure_model, and what the Trainer
// does to the whole model between configure_model and setup_module (move it to root_device(), then
// the precision plugin's convert_module), applicable to one part of it. A sharded strategy prepares
// and shards each block as the Module builds it (fulgur::built_block), so that no rank ever holds
// the whole model; the Trainer's later pass over the whole model finds those blocks done.
struct ModelBuild {
  std::function<void()> configure;                  // runs the Module's configure_model
  std::function<void(torch::nn::Module&)> prepare;  // device, then precision, for one block
};

class FULGUR_SDK_API Strategy {
 public:
  virtual ~Strategy();

  // True when every device needs a process of its own (ddp). With `devices = N` and no launcher
  // detected (torchrun, SLURM, MPI), the Trainer then starts N-1 more copies of the program.
  virtual bool launches_processes() const { return false; }

  // Called once per process before anything touches the model.
  virtual void setup_environment(const StrategyEnvironment& environment) = 0;
  virtual c10::Device root_device() const = 0;
  virtual const ClusterInfo& cluster() const = 0;
  bool is_global_zero() const { return cluster().global_rank == 0; }

  // Runs the Module's configure_model (build.configure), where layers may be created. Blocks the
  // Module marks with fulgur::built_block while it builds reach this strategy's BlockHooks (if it
  // installed some), where build.prepare puts a block where setup_module expects it, and a sharded
  // strategy keeps only its shards. Runs before setup_module. Default: build.configure().
  virtual void configure_model(torch::nn::Module& module, const ModelBuild& build);
  // Moves/wraps/shards the model and hooks gradient synchronization. Runs after the precision
  // plugin's convert_module (the parameters are in their training dtype, on root_device()) and
  // before the Module's configure_optimizers, so optimizers are created over the parameters this
  // returns to.
  virtual void setup_module(torch::nn::Module& module) = 0;
  // Sees the optimizers configure_optimizers returned, and may wrap or replace entries (a
  // replacement must keep param_groups() in the same order: LR schedulers and checkpoints
  // address groups by index).
  virtual void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers);

  // Before each training forward; `sync_gradients` as for backward() below.
  virtual void before_training_step(bool /*sync_gradients*/) {}
  // backward of `loss` through the precision plugin's scaling; `sync_gradients` is false on
  // gradient-accumulation micro-steps so that data-parallel strategies skip communication.
  virtual void backward(const at::Tensor& loss, Precision& precision, bool sync_gradients) = 0;
  // Clips the (unscaled) gradients of `optimizer`; a sharded strategy clips by the global norm
  // across shards. Default: the precision plugin clips the local gradients.
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, Precision& precision, double clip_value,
                              GradClipAlgorithm algorithm);
  // Steps through the precision plugin (which skips on inf/NaN gradients); returns whether the
  // step was taken. A sharded strategy agrees the skip across ranks.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, Precision& precision) = 0;
  // Why a training step under this strategy cannot be recorded as a StepGraph (communication
  // decided on the host, hooks that run per step), or "" when backward() and clip_gradients()
  // only queue device work and the optimizer may be stepped on its own parameters by the
  // Trainer's capturable step. Default: a refusal, so a plugin opts in knowingly.
  virtual std::string step_capture_refusal() const;
  // Whether optimizer_step does nothing but precision.optimizer_step(optimizer) (no agreement
  // across ranks, no shards to refresh after the step): the Trainer may then take a step that the
  // precision decides on the device (Precision::device_found_inf) without calling optimizer_step.
  // Default: false.
  virtual bool delegates_optimizer_step() const;

  virtual at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  virtual void broadcast(at::Tensor& tensor, int64_t src) = 0;
  virtual std::string broadcast_string(const std::string& value, int64_t src) = 0;
  virtual void barrier(std::string_view name) = 0;
  // Agreement across ranks: all ranks true (all=true) or any rank true (all=false).
  virtual bool reduce_boolean_decision(bool decision, bool all) = 0;

  // Which slice of the data this process reads.
  virtual int64_t data_parallel_rank() const = 0;
  virtual int64_t data_parallel_size() const = 0;

  // ---- state and checkpoints -------------------------------------------------------------------
  // The model's state as checkpoints store it. Default: every parameter and buffer by its dotted
  // Python name (a GenericDict str -> Tensor), detached, not copied.
  virtual c10::IValue module_state_dict(torch::nn::Module& module);
  // Restores what module_state_dict produced (or a Python/Lightning state_dict). With `strict`,
  // missing, unexpected and mis-shaped keys throw fulgur::Error(checkpoint) naming `origin`.
  virtual void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                                      const std::string& origin);
  // One optimizer's state, in torch.optim's state_dict layout where the optimizer is known.
  virtual c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer);
  virtual void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                         const std::string& origin);
  // Writes a checkpoint at `path`. A collective: every rank calls it with its own parts. Default:
  // rank zero joins the parts into one Lightning-layout dict and writes one file atomically
  // (fulgur/checkpoint_io.h); the others wait at a barrier.
  virtual void save_checkpoint(const CheckpointParts& parts, const std::string& path);
  // Reads what save_checkpoint wrote (or a PyTorch/Lightning file) into `out`: the model state,
  // the optimizer states (left empty for a weights-only checkpoint) and the other keys. A
  // missing, corrupt or foreign checkpoint throws fulgur::Error(checkpoint) naming the path.
  virtual void load_checkpoint(const std::string& path, const CheckpointParts& out);
  // Whether `path` holds a checkpoint this strategy can read (a file, or a sharded directory).
  virtual bool is_checkpoint(const std::string& path) const;

  // Releases what setup_environment took (the process group, the device); called once when the
  // Trainer is destroyed.
  virtual void teardown() {}
};

}  // namespace fulgur
