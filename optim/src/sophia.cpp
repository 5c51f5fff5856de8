// SophiaG's steps, mirroring sophia.py's _single_tensor_sophiag (capturable=False) and
// update_hessian line by line.
#include <fulgur/optim/sophia.h>

#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include "closure.h"

namespace fulgur::optim {

SophiaGOptions::SophiaGOptions(double lr) : lr_(lr) {}

bool operator==(const SophiaGOptions& lhs, const SophiaGOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.rho() == rhs.rho() &&
         lhs.weight_decay() == rhs.weight_decay() && lhs.bs() == rhs.bs() && lhs.maximize() == rhs.maximize();
}

void SophiaGOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(rho);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bs);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
}

void SophiaGOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, rho);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, bs);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
}

double SophiaGOptions::get_lr() const { return lr(); }
void SophiaGOptions::set_lr(const double lr) { this->lr(lr); }

bool operator==(const SophiaGParamState& lhs, const SophiaGParamState& rhs) {
  return lhs.step() == rhs.step() && torch::equal(lhs.exp_avg(), rhs.exp_avg()) &&
         torch::equal(lhs.hessian(), rhs.hessian());
}

void SophiaGParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(hessian);
}

void SophiaGParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, hessian);
}

SophiaG::SophiaG(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SophiaGOptions defaults)
    : Optimizer(param_groups, std::make_unique<SophiaGOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0, "SophiaG: invalid learning rate ", defaults.lr());
  const auto [beta1, beta2] = defaults.betas();
  TORCH_CHECK(0 <= beta1 && beta1 < 1, "SophiaG: invalid beta1 ", beta1, " (must be in [0, 1))");
  TORCH_CHECK(0 <= beta2 && beta2 < 1, "SophiaG: invalid beta2 ", beta2, " (must be in [0, 1))");
  TORCH_CHECK(defaults.rho() >= 0, "SophiaG: invalid rho ", defaults.rho());
  TORCH_CHECK(defaults.weight_decay() >= 0, "SophiaG: invalid weight_decay ", defaults.weight_decay());
  TORCH_CHECK(defaults.bs() > 0, "SophiaG: bs must be > 0, got ", defaults.bs());
}

namespace {
SophiaGParamState& state_of(torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  auto& slot = optimizer.state()[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto s = std::make_unique<SophiaGParamState>();
    s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    s->hessian(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  return static_cast<SophiaGParamState&>(*slot);
}
}  // namespace

void SophiaG::update_hessian() {
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const SophiaGOptions&>(group.options());
    const double beta2 = std::get<1>(options.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      state_of(*this, p).hessian().mul_(beta2).addcmul_(p.grad(), p.grad(), 1 - beta2);
    }
  }
}

void SophiaG::refresh_hessian(const std::function<torch::Tensor()>& sampled_loss) {
  zero_grad();
  {
    at::AutoGradMode enable_grad(true);
    sampled_loss().backward();
  }
  update_hessian();
  zero_grad();
}

void SophiaG::refresh_hessian_hutchinson(const std::function<torch::Tensor()>& loss) {
  zero_grad();
  std::vector<torch::Tensor> params;
  std::vector<double> beta2s;
  for (auto& group : param_groups_)
    for (auto& p : group.params())
      if (p.requires_grad()) {
        params.push_back(p);
        beta2s.push_back(std::get<1>(static_cast<const SophiaGOptions&>(group.options()).betas()));
      }
  if (params.empty()) return;
  std::vector<torch::Tensor> directions, products;
  {
    at::AutoGradMode enable_grad(true);
    const torch::Tensor value = loss();
    TORCH_CHECK(value.numel() == 1, "SophiaG: the Hutchinson refresh needs a scalar loss, got shape ", value.sizes());
    // create_graph: the gradient is differentiated again, along u (allow_unused: a parameter the
    // loss does not reach gets a zero product).
    const std::vector<torch::Tensor> grads =
        torch::autograd::grad({value}, params, {}, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
    torch::Tensor inner;
    for (size_t i = 0; i < params.size(); ++i) {
      directions.push_back(torch::randn_like(params[i]));
      if (!grads[i].defined()) continue;
      const torch::Tensor term = (grads[i] * directions[i]).sum();
      inner = inner.defined() ? inner + term : term;
    }
    if (inner.defined() && inner.requires_grad())
      products = torch::autograd::grad({inner}, params, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor& hessian = state_of(*this, params[i]).hessian();
    hessian.mul_(beta2s[i]);
    if (i < products.size() && products[i].defined()) hessian.addcmul_(directions[i], products[i], 1 - beta2s[i]);
  }
  zero_grad();
}

torch::Tensor SophiaG::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  const torch::Tensor loss = detail::evaluate_closure(closure);
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const SophiaGOptions&>(group.options());
    const double lr = o.lr(), rho = o.rho(), wd = o.weight_decay(), bs = static_cast<double>(o.bs());
    const double beta1 = std::get<0>(o.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "SophiaG does not support sparse gradients");
      const torch::Tensor grad = o.maximize() ? -p.grad() : p.grad();
      auto& state = state_of(*this, p);
      state.step(state.step() + 1);
      p.mul_(1 - lr * wd);
      state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
      // The paper's max(rho * h, eps): a Hutchinson estimate may be negative, where the step is the
      // clipped sign (sophia.py's rho * h + 1e-15 is the same for the never-negative GNB estimate).
      const torch::Tensor ratio =
          (state.exp_avg().abs() / ((rho * bs * state.hessian()).clamp_min(0) + 1e-15)).clamp_max(1);
      p.addcmul_(state.exp_avg().sign(), ratio, -lr);
    }
  }
  return loss;
}

void SophiaG::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }
void SophiaG::load(torch::serialize::InputArchive& archive) { serialize(*this, archive); }

torch::Tensor gnb_sampled_labels(const torch::Tensor& logits) {
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = logits.detach().reshape({-1, logits.size(-1)});
  return torch::multinomial(torch::softmax(flat, -1), 1, /*replacement=*/true)
      .squeeze(-1)
      .reshape(logits.sizes().slice(0, logits.dim() - 1));
}

}  // namespace fulgur::optim
