// Communicator: the collectives a Strategy may use. The core implements it over LibTorch c10d
// (TCPStore + Gloo/NCCL); strategies never include c10d headers themselves.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <memory>
#include <vector>

namespace fulgur {

// An in-flight asynchronous collective (for gradient buckets overlapping backward).
class FULGUR_SDK_API PendingCollective {
 public:
  virtual ~PendingCollective();
  virtual void wait() = 0;
};

class FULGUR_SDK_API Communicator {
 public:
  virtual ~Communicator();

  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual std::string backend() const = 0;  // "gloo", "nccl"

  virtual void all_reduce(at::Tensor& tensor, ReduceOp op) = 0;  // in place
  virtual std::unique_ptr<PendingCollective> all_reduce_async(at::Tensor& tensor, ReduceOp op) = 0;
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  virtual void broadcast(at::Tensor& tensor, int64_t src) = 0;
  virtual void reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op) = 0;
  virtual void barrier() = 0;
};

}  // namespace fulgur
