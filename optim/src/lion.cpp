// Lion's step. The operation order copies lion-pytorch 0.2.5's update_fn, so both round alike.
#include <fulgur/optim/lion.h>

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include "closure.h"

namespace fulgur::optim {

LionOptions::LionOptions(double lr) : lr_(lr) {}

bool operator==(const LionOptions& lhs, const LionOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.weight_decay() == rhs.weight_decay();
}

void LionOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
}

void LionOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
}

double LionOptions::get_lr() const { return lr(); }
void LionOptions::set_lr(const double lr) { this->lr(lr); }

bool operator==(const LionParamState& lhs, const LionParamState& rhs) {
  return torch::equal(lhs.exp_avg(), rhs.exp_avg());
}

void LionParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
}

void LionParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
}

Lion::Lion(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LionOptions defaults)
    : Optimizer(param_groups, std::make_unique<LionOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() > 0, "Lion: invalid learning rate ", defaults.lr(), " (must be > 0)");
  const auto [beta1, beta2] = defaults.betas();
  TORCH_CHECK(0 <= beta1 && beta1 <= 1, "Lion: invalid beta1 ", beta1, " (must be in [0, 1])");
  TORCH_CHECK(0 <= beta2 && beta2 <= 1, "Lion: invalid beta2 ", beta2, " (must be in [0, 1])");
  TORCH_CHECK(defaults.weight_decay() >= 0, "Lion: invalid weight_decay ", defaults.weight_decay());
}

torch::Tensor Lion::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  const torch::Tensor loss = detail::evaluate_closure(closure);
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const LionOptions&>(group.options());
    const double lr = options.lr(), wd = options.weight_decay();
    const auto [beta1, beta2] = options.betas();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto& grad = p.grad();
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto state = std::make_unique<LionParamState>();
        state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(state);
      }
      auto& exp_avg = static_cast<LionParamState&>(*slot).exp_avg();
      p.mul_(1. - lr * wd);
      auto update = exp_avg.clone().mul_(beta1).add(grad, 1. - beta1).sgn_();
      p.add_(update, -lr);
      exp_avg.mul_(beta2).add_(grad, 1. - beta2);
    }
  }
  return loss;
}

void Lion::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }
void Lion::load(torch::serialize::InputArchive& archive) { serialize(*this, archive); }

}  // namespace fulgur::optim
