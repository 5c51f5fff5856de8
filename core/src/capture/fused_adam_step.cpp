#include "fused_adam_step.h"

#include <fulgur/error.h>
#include <fulgur/precision.h>

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_sub.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <optional>
#include <typeinfo>

namespace fulgur {

namespace {

// The options every Adam flavour shares, read from a group's options object.
struct AdamHyperparameters {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool amsgrad = false;
  bool operator==(const AdamHyperparameters& o) const {
    return beta1 == o.beta1 && beta2 == o.beta2 && eps == o.eps && weight_decay == o.weight_decay &&
           amsgrad == o.amsgrad;
  }
};

template <class Options>
AdamHyperparameters read(const Options& o) {
  return {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad()};
}

AdamHyperparameters hyperparameters_of(torch::optim::OptimizerOptions& options) {
  if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) return read(*adamw);
  return read(dynamic_cast<torch::optim::AdamOptions&>(options));
}

// Adam and AdamW keep the same fields in two unrelated state classes.
template <class State>
State& state_for(torch::optim::Optimizer& optimizer, const at::Tensor& p, bool amsgrad) {
  auto& states = optimizer.state();
  auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end()) {
    // What the optimizer's own first step() creates.
    auto state = std::make_unique<State>();
    state->step(0);
    state->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    state->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (amsgrad) state->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = states.emplace(p.unsafeGetTensorImpl(), std::move(state)).first;
  }
  auto& state = static_cast<State&>(*it->second);
  if (amsgrad && !state.max_exp_avg_sq().defined()) state.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  return state;
}

}  // namespace

// One param group: its parameters by dtype (the fused kernels take one dtype per call), each with
// its state tensors and a device step count; the host state objects, to keep their steps equal.
struct FusedAdamStep::Group {
  AdamHyperparameters hp;
  at::Tensor lr;          // float32 on the parameters' device: the fused kernels read it at every launch
  double lr_written = 0;  // the host value lr holds (a fill is a kernel launch: only on change)
  struct Parameter {
    at::Tensor param, exp_avg, exp_avg_sq, max_exp_avg_sq, step;
    torch::optim::OptimizerParamState* host = nullptr;
  };
  std::map<std::pair<c10::ScalarType, std::string>, std::vector<Parameter>> by_dtype;
  size_t parameter_count = 0;          // of the optimizer's group when it was recorded
  std::vector<at::Tensor> unrecorded;  // parameters without state or gradient then (uncaptured steps)
};

namespace {

using Parameter = FusedAdamStep::Group::Parameter;

// Parameter `p`'s entry over its (created if missing) state.
template <class State>
Parameter recorded_entry(torch::optim::Optimizer& optimizer, const at::Tensor& p, bool amsgrad) {
  State& s = state_for<State>(optimizer, p, amsgrad);
  Parameter entry;
  entry.param = p;
  entry.exp_avg = s.exp_avg();
  entry.exp_avg_sq = s.exp_avg_sq();
  entry.max_exp_avg_sq = s.max_exp_avg_sq();
  entry.step = at::full({}, static_cast<double>(s.step()), p.options().dtype(at::kFloat));
  entry.host = &s;
  return entry;
}

// The optimizer's state object of `entry`'s parameter when it is still the one recorded: the same
// object holding the recorded tensor (an address alone could be a new object allocated where a
// replaced one was; the recorded tensor keeps its storage alive). Null when a callback or a
// checkpoint load replaced or removed it: the recorded pointer may then point to freed memory, and
// the replacement brings its own count (adopt_replaced_state() takes it over at the next step).
template <class State>
State* recorded_host(torch::optim::Optimizer& optimizer, const Parameter& entry) {
  auto& states = optimizer.state();
  const auto it = states.find(entry.param.unsafeGetTensorImpl());
  if (it == states.end() || it->second.get() != entry.host) return nullptr;
  auto& state = static_cast<State&>(*it->second);
  return state.exp_avg().is_same(entry.exp_avg) ? &state : nullptr;
}

template <class State>
void advance_host_step(torch::optim::Optimizer& optimizer, Parameter& entry) {
  if (State* s = recorded_host<State>(optimizer, entry)) s->step(s->step() + 1);
}

template <class State>
void set_host_step(Parameter& entry, int64_t step) {
  static_cast<State&>(*entry.host).step(step);
}

template <class State>
void adopt(torch::optim::Optimizer& optimizer, Parameter& e, bool amsgrad) {
  auto& states = optimizer.state();
  auto it = states.find(e.param.unsafeGetTensorImpl());
  if (it == states.end()) {  // cleared: a fresh state, in the recorded tensors
    e.exp_avg.zero_();
    e.exp_avg_sq.zero_();
    if (amsgrad) e.max_exp_avg_sq.zero_();
    e.step.zero_();
    auto state = std::make_unique<State>();
    state->step(0);
    state->exp_avg(e.exp_avg);
    state->exp_avg_sq(e.exp_avg_sq);
    if (amsgrad) state->max_exp_avg_sq(e.max_exp_avg_sq);
    e.host = state.get();
    states.emplace(e.param.unsafeGetTensorImpl(), std::move(state));
    return;
  }
  auto& state = static_cast<State&>(*it->second);
  const bool same = it->second.get() == e.host && state.exp_avg().is_same(e.exp_avg) &&
                    state.exp_avg_sq().is_same(e.exp_avg_sq) &&
                    (!amsgrad || state.max_exp_avg_sq().is_same(e.max_exp_avg_sq));
  if (same) return;
  e.exp_avg.copy_(state.exp_avg());
  e.exp_avg_sq.copy_(state.exp_avg_sq());
  if (amsgrad) {
    if (state.max_exp_avg_sq().defined())
      e.max_exp_avg_sq.copy_(state.max_exp_avg_sq());
    else
      e.max_exp_avg_sq.zero_();
  }
  e.step.fill_(static_cast<double>(state.step()));
  state.exp_avg(e.exp_avg);
  state.exp_avg_sq(e.exp_avg_sq);
  if (amsgrad) state.max_exp_avg_sq(e.max_exp_avg_sq);
  e.host = &state;
}

}  // namespace

std::string FusedAdamStep::refusal(torch::optim::Optimizer& optimizer) {
  // The exact classes: a subclass may override step(), which the fused kernels would bypass.
  const std::type_info& type = typeid(optimizer);
  if (type != typeid(torch::optim::Adam) && type != typeid(torch::optim::AdamW))
    return fmt::format(
        "the optimizer is not torch::optim::Adam or AdamW{}, the two with fused kernels whose step count and "
        "learning rate live on the device (a recorded step would freeze them)",
        dynamic_cast<torch::optim::Adam*>(&optimizer) || dynamic_cast<torch::optim::AdamW*>(&optimizer)
            ? " but a class derived from one (its own step() would be bypassed)"
            : "");
  for (auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (!at::isFloatingType(p.scalar_type()))
        return fmt::format("a parameter of dtype {} cannot be stepped by the fused Adam kernels",
                           c10::toString(p.scalar_type()));
  return {};
}

FusedAdamStep::FusedAdamStep(torch::optim::Optimizer& optimizer)
    : optimizer_(optimizer), decoupled_weight_decay_(dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {}

FusedAdamStep::~FusedAdamStep() = default;

void FusedAdamStep::sync_from_host(bool every_parameter) {
  sync_host_steps();  // the device counts are the current ones where steps read found_inf
  synced_ = true;
  groups_.clear();
  last_.clear();
  captured_.clear();
  for (auto& group : optimizer_.param_groups()) {
    auto g = std::make_unique<Group>();
    g->hp = hyperparameters_of(group.options());
    g->parameter_count = group.params().size();
    for (const auto& p : group.params()) {
      // As the optimizer's own step(): no state for a parameter before it has a gradient (frozen
      // ones may never have one). A recorded step needs every tensor it may touch up front.
      if (!every_parameter && !p.grad().defined() && !optimizer_.state().count(p.unsafeGetTensorImpl())) {
        g->unrecorded.push_back(p);
        continue;
      }
      g->by_dtype[{p.scalar_type(), p.device().str()}].push_back(
          decoupled_weight_decay_ ? recorded_entry<torch::optim::AdamWParamState>(optimizer_, p, g->hp.amsgrad)
                                  : recorded_entry<torch::optim::AdamParamState>(optimizer_, p, g->hp.amsgrad));
    }
    const at::Tensor first = group.params().empty() ? at::Tensor() : group.params().front();
    g->lr = at::full({}, g->hp.lr,
                     at::TensorOptions()
                         .dtype(at::kFloat)
                         .device(first.defined() ? first.device() : c10::Device(c10::DeviceType::CPU)));
    g->lr_written = g->hp.lr;
    groups_.push_back(std::move(g));
  }
}

void FusedAdamStep::before_step(bool recorded) {
  if (!synced_) sync_from_host(/*every_parameter=*/recorded);
  adopt_replaced_state();  // a callback or a checkpoint load may have replaced it
  if (recorded) {
    check_hyperparameters();
  } else {
    // An uncaptured step reads the groups as they are now (a callback may change betas, or add
    // a group): record them again when they changed.
    auto& groups = optimizer_.param_groups();
    bool changed = groups.size() != groups_.size();
    for (size_t i = 0; !changed && i < groups.size(); ++i)
      changed = !(hyperparameters_of(groups[i].options()) == groups_[i]->hp) ||
                groups[i].params().size() != groups_[i]->parameter_count;
    for (size_t i = 0; !changed && i < groups_.size(); ++i)
      for (const at::Tensor& p : groups_[i]->unrecorded) changed = changed || p.grad().defined();  // unfrozen
    if (changed) sync_from_host(/*every_parameter=*/false);
  }
  refresh_lr();  // schedulers move the host lr; the device copy is read at the launch
}

void FusedAdamStep::refresh_lr() {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups_.size() && i < groups.size(); ++i) {
    const double lr = groups[i].options().get_lr();
    if (lr == groups_[i]->lr_written) continue;
    groups_[i]->lr.fill_(lr);
    groups_[i]->lr_written = lr;
  }
}

void FusedAdamStep::check_hyperparameters() const {
  auto& groups = optimizer_.param_groups();
  if (groups.size() != groups_.size())
    throw Error(ErrorKind::config, fmt::format("cuda_graphs: the optimizer has {} param groups, the captured step "
                                               "{}; groups cannot be added while steps are captured",
                                               groups.size(), groups_.size()));
  for (size_t i = 0; i < groups.size(); ++i) {
    const AdamHyperparameters now = hyperparameters_of(groups[i].options());
    if (!(now == groups_[i]->hp))
      throw Error(ErrorKind::config,
                  fmt::format("cuda_graphs: param group {} changed betas, eps, weight_decay or amsgrad after the step "
                              "was captured (only lr is read at each replay); keep them fixed, or set cuda_graphs = "
                              "\"off\"",
                              i));
  }
}

void FusedAdamStep::adopt_replaced_state() {
  for (auto& g : groups_)
    for (auto& [key, entries] : g->by_dtype)
      for (auto& e : entries) {
        if (decoupled_weight_decay_)
          adopt<torch::optim::AdamWParamState>(optimizer_, e, g->hp.amsgrad);
        else
          adopt<torch::optim::AdamParamState>(optimizer_, e, g->hp.amsgrad);
      }
}

void FusedAdamStep::step(const at::Tensor& found_inf) {
  last_.clear();
  last_read_found_inf_ = found_inf.defined();
  if (last_read_found_inf_ && !announced_found_inf_) {
    announced_found_inf_ = true;
    spdlog::debug(
        "optimizer steps are decided on the device: fused Adam kernels skip a step whose gradients are not "
        "finite, with no host synchronisation per step");
  }
  const std::optional<at::Tensor> skip = found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt;
  for (auto& g : groups_) {
    for (auto& [key, entries] : g->by_dtype) {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
      for (auto& e : entries) {
        const at::Tensor& grad = e.param.grad();
        if (!grad.defined()) continue;  // as Adam: a parameter without a gradient is not stepped
        params.push_back(e.param);
        grads.push_back(grad);
        exp_avgs.push_back(e.exp_avg);
        exp_avg_sqs.push_back(e.exp_avg_sq);
        if (g->hp.amsgrad) max_exp_avg_sqs.push_back(e.max_exp_avg_sq);
        steps.push_back(e.step);
        last_.push_back(&e);
      }
      if (params.empty()) continue;
      // The kernels read the incremented count (Python's fused Adam adds 1 before calling them).
      at::_foreach_add_(steps, 1);
      // A tensor lr on the CPU makes the kernel read it on the host; keep it there on the CPU.
      // With found_inf = 1 the kernels return before touching anything; the counts they were
      // handed are taken back (Python's fused Adam does the same after the kernel).
      if (decoupled_weight_decay_)
        at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, g->lr, g->hp.beta1, g->hp.beta2,
                          g->hp.weight_decay, g->hp.eps, g->hp.amsgrad, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                          skip);
      else
        at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, g->lr, g->hp.beta1, g->hp.beta2,
                         g->hp.weight_decay, g->hp.eps, g->hp.amsgrad, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                         skip);
      if (skip) at::_foreach_sub_(steps, std::vector<at::Tensor>(steps.size(), found_inf));
    }
  }
}

void FusedAdamStep::step_decided_by(DeviceStepPrecision* precision, const at::Tensor& found_inf) {
  try {
    step(found_inf);
  } catch (...) {
    if (precision) precision->update_after_device_step(optimizer_, at::Tensor());  // abandoned: forget the unscale
    throw;
  }
  if (found_inf.defined() && precision) precision->update_after_device_step(optimizer_, found_inf);
}

void FusedAdamStep::advance_host_steps(bool replayed) {
  // Where the step read found_inf only the device knows whether it was taken: the host counts
  // advance as if it was (what a callback reading them mid-fit is least surprised by) and are
  // corrected by sync_host_steps().
  if (replayed ? captured_reads_found_inf_ : last_read_found_inf_) host_steps_stale_ = true;
  for (void* entry : replayed ? captured_ : last_) {
    auto& parameter = *static_cast<Group::Parameter*>(entry);
    if (decoupled_weight_decay_)
      advance_host_step<torch::optim::AdamWParamState>(optimizer_, parameter);
    else
      advance_host_step<torch::optim::AdamParamState>(optimizer_, parameter);
  }
}

void FusedAdamStep::sync_host_steps() {
  if (!host_steps_stale_) return;
  host_steps_stale_ = false;
  for (auto& g : groups_)
    for (auto& [key, entries] : g->by_dtype) {
      // The entries whose state object is still the one recorded (a replaced state brought its own
      // count, and adopt_replaced_state() takes it over at the next step).
      std::vector<Parameter*> current;
      std::vector<at::Tensor> steps;
      for (auto& e : entries) {
        const bool recorded = decoupled_weight_decay_
                                  ? recorded_host<torch::optim::AdamWParamState>(optimizer_, e) != nullptr
                                  : recorded_host<torch::optim::AdamParamState>(optimizer_, e) != nullptr;
        if (!recorded) continue;
        current.push_back(&e);
        steps.push_back(e.step);
      }
      if (steps.empty()) continue;
      const at::Tensor counts = at::stack(steps).to(at::kDouble).cpu();  // one synchronisation per dtype
      const double* values = counts.data_ptr<double>();
      for (size_t i = 0; i < current.size(); ++i) {
        const auto count = static_cast<int64_t>(std::llround(values[i]));
        if (decoupled_weight_decay_)
          set_host_step<torch::optim::AdamWParamState>(*current[i], count);
        else
          set_host_step<torch::optim::AdamParamState>(*current[i], count);
      }
    }
}

}  // namespace fulgur
