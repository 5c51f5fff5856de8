// The Metric base: states, reset, and their synchronisation across ranks at compute().
#include <fulgur/error.h>
#include <fulgur/metric.h>
#include <fulgur/strategy.h>

#include <torch/torch.h>

#include "binding.h"

namespace fulgur::metrics {

namespace {

// Collectives through the strategy of the Trainer that runs `module`, found at each call: the
// binding changes between stages and is absent outside a run.
class ModuleSync : public MetricSync {
 public:
  explicit ModuleSync(const Module& module) : module_(&module) {}
  int64_t world_size() const override {
    Strategy* s = strategy();
    return s ? s->cluster().world_size : 1;
  }
  at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op) override { return strategy()->reduce(tensor, op); }
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
    // c10d gathers equal shapes only: agree on the largest first dimension, pad, gather, trim.
    Strategy& s = *strategy();
    const at::Tensor size = at::full({1}, tensor.size(0), tensor.options().dtype(at::kLong));
    std::vector<at::Tensor> sizes = s.all_gather(size);
    int64_t most = 0;
    for (const auto& n : sizes) most = std::max(most, n.item<int64_t>());
    std::vector<int64_t> padded_shape = tensor.sizes().vec();
    padded_shape[0] = most;
    at::Tensor padded = at::zeros(padded_shape, tensor.options());
    padded.narrow(0, 0, tensor.size(0)).copy_(tensor);
    std::vector<at::Tensor> parts = s.all_gather(padded);
    for (size_t r = 0; r < parts.size(); ++r) parts[r] = parts[r].narrow(0, 0, sizes[r].item<int64_t>());
    return parts;
  }

 private:
  Strategy* strategy() const {
    const Module::Binding* b = module_->binding();
    return b ? b->strategy : nullptr;
  }
  const Module* module_;
};

ReduceOp to_reduce_op(StateReduction r) {
  switch (r) {
    case StateReduction::max:
      return ReduceOp::max;
    case StateReduction::min:
      return ReduceOp::min;
    default:
      return ReduceOp::sum;
  }
}

}  // namespace

MetricSync::~MetricSync() = default;
Metric::~Metric() = default;

size_t Metric::add_state(std::string name, at::Tensor initial, StateReduction reduction) {
  State s{std::move(name), initial, reduction, reduction == StateReduction::cat ? at::Tensor() : initial.clone(), {}};
  states_.push_back(std::move(s));
  return states_.size() - 1;
}

void Metric::append(size_t index, const at::Tensor& chunk) { states_[index].chunks.push_back(chunk.detach()); }

at::Tensor Metric::state_value(size_t index) const {
  const State& s = states_[index];
  if (s.reduction != StateReduction::cat) return s.value;
  if (s.chunks.empty()) return s.initial;  // an empty (0, ...) tensor of the right dtype
  return s.chunks.size() == 1 ? s.chunks.front() : at::cat(s.chunks);
}

void Metric::reset() {
  for (State& s : states_) {
    s.chunks.clear();
    if (s.reduction != StateReduction::cat) s.value = s.initial.clone();
  }
}

Metric& Metric::sync_with(const Module& module) {
  sync_ = std::make_shared<ModuleSync>(module);
  return *this;
}

Metric& Metric::sync_with(std::shared_ptr<MetricSync> sync) {
  sync_ = std::move(sync);
  return *this;
}

at::Tensor Metric::compute() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> values;
  values.reserve(states_.size());
  const bool distributed = sync_ && sync_->world_size() > 1;
  for (size_t i = 0; i < states_.size(); ++i) {
    at::Tensor local = state_value(i);
    if (!distributed)
      values.push_back(local);
    else if (states_[i].reduction == StateReduction::cat)
      values.push_back(at::cat(sync_->all_gather(local.contiguous())));
    else
      // Out of place: the local state stays this rank's own, so updates may continue after compute.
      values.push_back(sync_->all_reduce(local.clone(), to_reduce_op(states_[i].reduction)));
  }
  return compute_from(values);
}

}  // namespace fulgur::metrics
