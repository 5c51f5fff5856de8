// Strategy: how training is spread over processes and devices (single_device, ddp, fsdp, ...).
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

  // Moves/wraps/shards the model and hooks gradient synchronization; then sees the optimizers.
  virtual void setup_module(torch::nn::Module& module) = 0;
  virtual void setup_optimizers(std::span<torch::optim::Optimizer* const> optimizers) = 0;

  // Before each training forward; `sync_gradients` as for backward() below.
  virtual void before_training_step(bool /*sync_gradients*/) {}
  // backward of `loss` through the precision plugin's scaling; `sync_gradients` is false on
  // gradient-accumulation micro-steps so that data-parallel strategies skip communication.
  virtual void backward(const at::Tensor& loss, Precision& precision, bool sync_gradients) = 0;
  // Steps through the precision plugin; returns whether the step was taken.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, Precision& precision) = 0;

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

  // Writes/reads a checkpoint dict (rank zero writes for replicated strategies).
  virtual void save_checkpoint(const c10::IValue& checkpoint, const std::string& path) = 0;
  virtual void load_checkpoint(const std::string& path, c10::IValue& checkpoint) = 0;

  virtual void teardown() = 0;
};

}  // namespace fulgur
