#include "distributed/host_staged_backend.h"

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <torch/torch.h>

#include <utility>
#include <vector>

namespace fulgur::detail {

namespace {

at::Tensor to_host(const at::Tensor& t) { return t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/false).contiguous(); }

std::vector<at::Tensor> to_host(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(to_host(t));
  return out;
}

std::vector<std::vector<at::Tensor>> to_host(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& list : lists) out.push_back(to_host(list));
  return out;
}

// Results back into the caller's device tensors (a copy to the same storage when `device` was
// already a host tensor that `to_host` returned as is).
void copy_back(std::vector<at::Tensor>& device, const std::vector<at::Tensor>& host) {
  for (size_t i = 0; i < device.size(); ++i)
    if (!device[i].is_same(host[i])) device[i].copy_(host[i]);
}

void copy_back(std::vector<std::vector<at::Tensor>>& device, const std::vector<std::vector<at::Tensor>>& host) {
  for (size_t i = 0; i < device.size(); ++i) copy_back(device[i], host[i]);
}

// A collective that has already run: its result is the device tensors.
class CompletedWork final : public c10d::Work {
 public:
  CompletedWork(std::vector<at::Tensor> result, c10d::OpType type)
      : c10d::Work(-1, type),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(result_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

c10::intrusive_ptr<c10d::Work> done(std::vector<at::Tensor> result, c10d::OpType type) {
  return c10::make_intrusive<CompletedWork>(std::move(result), type);
}

class HostStagedBackend final : public c10d::Backend {
 public:
  explicit HostStagedBackend(c10::intrusive_ptr<c10d::Backend> host)
      : c10d::Backend(host->getRank(), host->getSize()), host_(std::move(host)) {}

  const std::string getBackendName() const override { return host_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto host = to_host(tensors);
    host_->broadcast(host, opts)->wait();
    copy_back(tensors, host);
    return done(tensors, c10d::OpType::BROADCAST);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto host = to_host(tensors);
    host_->allreduce(host, opts)->wait();
    copy_back(tensors, host);
    return done(tensors, c10d::OpType::ALLREDUCE);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    auto host = to_host(tensors);
    host_->allreduce_coalesced(host, opts)->wait();
    copy_back(tensors, host);
    return done(tensors, c10d::OpType::ALLREDUCE_COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    auto host = to_host(tensors);
    host_->reduce(host, opts)->wait();
    copy_back(tensors, host);
    return done(tensors, c10d::OpType::REDUCE);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    auto host_out = to_host(outputs);
    auto host_in = to_host(inputs);
    host_->allgather(host_out, host_in, opts)->wait();
    copy_back(outputs, host_out);
    return done(outputs.empty() ? std::vector<at::Tensor>{} : outputs.front(), c10d::OpType::ALLGATHER);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    at::Tensor host_out = to_host(output), host_in = to_host(input);
    host_->_allgather_base(host_out, host_in, opts)->wait();
    if (!output.is_same(host_out)) output.copy_(host_out);
    return done({output}, c10d::OpType::_ALLGATHER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    auto host_out = to_host(outputs);
    auto host_in = to_host(inputs);
    host_->allgather_into_tensor_coalesced(host_out, host_in, opts)->wait();
    copy_back(outputs, host_out);
    return done(outputs, c10d::OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto host_out = to_host(outputs);
    auto host_in = to_host(inputs);
    host_->reduce_scatter(host_out, host_in, opts)->wait();
    copy_back(outputs, host_out);
    return done(outputs, c10d::OpType::REDUCE_SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    at::Tensor host_out = to_host(output), host_in = to_host(input);
    host_->_reduce_scatter_base(host_out, host_in, opts)->wait();
    if (!output.is_same(host_out)) output.copy_(host_out);
    return done({output}, c10d::OpType::_REDUCE_SCATTER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    auto host_out = to_host(outputs);
    auto host_in = to_host(inputs);
    host_->reduce_scatter_tensor_coalesced(host_out, host_in, opts)->wait();
    copy_back(outputs, host_out);
    return done(outputs, c10d::OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override { return host_->barrier(opts); }

 private:
  c10::intrusive_ptr<c10d::Backend> host_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_host_staged_backend(c10::intrusive_ptr<c10d::Backend> host) {
  return c10::make_intrusive<HostStagedBackend>(std::move(host));
}

}  // namespace fulgur::detail
