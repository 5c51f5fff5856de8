// Muon's and AdamW's steps. Each line mirrors torch/optim/_muon.py (_single_tensor_muon,
// _zeropower_via_newtonschulz, _adjust_lr) and torch/optim/adam.py (_single_tensor_adam with
// decoupled weight decay) of PyTorch 2.11, with the same scalars in double precision, so the
// results round exactly as Python's do.
#include <fulgur/optim/muon.h>

#include <ATen/ops/addmm.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>

#include "closure.h"

namespace fulgur::optim {

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

bool operator==(const MuonOptions& lhs, const MuonOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.weight_decay() == rhs.weight_decay() && lhs.use_muon() == rhs.use_muon() &&
         lhs.momentum() == rhs.momentum() && lhs.nesterov() == rhs.nesterov() &&
         lhs.ns_coefficients() == rhs.ns_coefficients() && lhs.eps() == rhs.eps() && lhs.ns_steps() == rhs.ns_steps() &&
         lhs.adjust_lr_fn() == rhs.adjust_lr_fn() && lhs.betas() == rhs.betas() && lhs.adamw_eps() == rhs.adamw_eps();
}

void MuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_muon);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_coefficients);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_steps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adjust_lr_fn);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adamw_eps);
}

void MuonOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_muon);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(coefficients_t, ns_coefficients);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, ns_steps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(std::string, adjust_lr_fn);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, adamw_eps);
}

double MuonOptions::get_lr() const { return lr(); }
void MuonOptions::set_lr(const double lr) { this->lr(lr); }

namespace {
bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || torch::equal(a, b));
}
}  // namespace

bool operator==(const MuonParamState& lhs, const MuonParamState& rhs) {
  return lhs.step() == rhs.step() && same(lhs.momentum_buffer(), rhs.momentum_buffer()) &&
         same(lhs.exp_avg(), rhs.exp_avg()) && same(lhs.exp_avg_sq(), rhs.exp_avg_sq());
}

void MuonParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}

void MuonParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
}

torch::Tensor zeropower_via_newtonschulz(const torch::Tensor& grad, MuonOptions::coefficients_t coefficients,
                                         int64_t steps, double eps) {
  TORCH_CHECK(steps < 100, "Muon: ns_steps must be less than 100, got ", steps);
  TORCH_CHECK(grad.dim() == 2, "Muon: Newton-Schulz needs a 2-D matrix, got a tensor of shape ", grad.sizes());
  const auto [a, b, c] = coefficients;
  torch::Tensor ortho = grad.to(torch::kBFloat16);
  // A bf16 input is returned as itself by .to(): copy it so the in-place division below leaves
  // the caller's tensor alone (PyTorch's .bfloat16() would divide the caller's tensor).
  if (grad.scalar_type() == torch::kBFloat16) ortho = ortho.clone();
  const bool tall = grad.size(0) > grad.size(1);
  if (tall) ortho = ortho.t();
  ortho.div_(ortho.norm().clamp_min(eps));
  for (int64_t i = 0; i < steps; ++i) {
    const torch::Tensor gram = torch::matmul(ortho, ortho.t());
    const torch::Tensor gram_update = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    ortho = at::addmm(ortho, gram_update, ortho, /*beta=*/a);
  }
  return tall ? ortho.t() : ortho;
}

double muon_adjusted_lr(double lr, const std::string& adjust_lr_fn, int64_t rows, int64_t cols) {
  const double A = static_cast<double>(rows), B = static_cast<double>(cols);
  if (adjust_lr_fn == "original") return lr * std::sqrt(std::max(1.0, A / B));
  if (adjust_lr_fn == "match_rms_adamw") return lr * (0.2 * std::sqrt(std::max(A, B)));
  return lr;
}

namespace {

void check_group(const torch::optim::OptimizerParamGroup& group, size_t index) {
  const auto& o = static_cast<const MuonOptions&>(group.options());
  TORCH_CHECK(o.lr() >= 0, "Muon: param group ", index, ": learning rate must be >= 0, got ", o.lr());
  TORCH_CHECK(o.weight_decay() >= 0, "Muon: param group ", index, ": weight_decay must be >= 0, got ",
              o.weight_decay());
  if (!o.use_muon()) {
    const auto [beta1, beta2] = o.betas();
    TORCH_CHECK(0 <= beta1 && beta1 < 1 && 0 <= beta2 && beta2 < 1, "Muon: AdamW param group ", index,
                ": betas must lie in [0, 1), got (", beta1, ", ", beta2, ")");
    TORCH_CHECK(o.adamw_eps() >= 0, "Muon: AdamW param group ", index, ": adamw_eps must be >= 0");
    return;
  }
  TORCH_CHECK(o.momentum() >= 0, "Muon: param group ", index, ": momentum must be >= 0, got ", o.momentum());
  TORCH_CHECK(o.adjust_lr_fn() == "original" || o.adjust_lr_fn() == "match_rms_adamw", "Muon: param group ", index,
              ": adjust_lr_fn '", o.adjust_lr_fn(), "' is not one of \"original\", \"match_rms_adamw\"");
  for (const auto& p : group.params())
    TORCH_CHECK(p.dim() == 2, "Muon: param group ", index, " holds a parameter of shape ", p.sizes(),
                "; Muon orthogonalizes 2-D matrices only. Put it in a group with use_muon(false) (AdamW), "
                "e.g. with fulgur::optim::muon_param_groups()");
}

void muon_step(torch::Tensor& param, const torch::Tensor& grad, MuonParamState& state, const MuonOptions& o,
               const MuonRowShard* shard) {
  TORCH_CHECK(!param.is_complex(), "Muon does not support complex parameters");
  TORCH_CHECK(!grad.is_sparse(), "Muon does not support sparse gradients");
  TORCH_CHECK(grad.dim() == 2, "Muon: the gradient must be a 2-D matrix");
  if (!state.momentum_buffer().defined()) state.momentum_buffer(torch::zeros_like(grad, torch::MemoryFormat::Preserve));
  auto& buf = state.momentum_buffer();
  const double momentum = o.momentum();
  buf.lerp_(grad, 1 - momentum);
  torch::Tensor update = o.nesterov() ? grad.lerp(buf, momentum) : buf;
  int64_t rows = param.size(0), cols = param.size(1);
  if (shard) {
    // Newton-Schulz starts by converting to bfloat16, element-wise: converting the rows first and
    // gathering them gives the very matrix one process converts, at half the bytes of float32.
    const torch::Tensor whole = shard->gather(update.to(torch::kBFloat16));
    TORCH_CHECK(whole.dim() == 2 && whole.size(0) == shard->rows && whole.size(1) == shard->cols,
                "Muon: the gathered matrix has shape ", whole.sizes(), ", expected [", shard->rows, ", ", shard->cols,
                "]");
    update = zeropower_via_newtonschulz(whole, o.ns_coefficients(), o.ns_steps(), o.eps())
                 .narrow(0, shard->first_row, param.size(0));
    rows = shard->rows;
    cols = shard->cols;
  } else {
    update = zeropower_via_newtonschulz(update, o.ns_coefficients(), o.ns_steps(), o.eps());
  }
  const double adjusted_lr = muon_adjusted_lr(o.lr(), o.adjust_lr_fn(), rows, cols);
  param.mul_(1 - o.lr() * o.weight_decay());
  param.add_(update, -adjusted_lr);
}

void adamw_step(torch::Tensor& param, const torch::Tensor& grad, MuonParamState& state, const MuonOptions& o) {
  if (!state.exp_avg().defined()) {
    state.exp_avg(torch::zeros_like(param, torch::MemoryFormat::Preserve));
    state.exp_avg_sq(torch::zeros_like(param, torch::MemoryFormat::Preserve));
  }
  const double lr = o.lr(), weight_decay = o.weight_decay(), eps = o.adamw_eps();
  const auto [beta1, beta2] = o.betas();
  state.step(state.step() + 1);
  if (weight_decay != 0) param.mul_(1 - lr * weight_decay);
  auto& exp_avg = state.exp_avg();
  auto& exp_avg_sq = state.exp_avg_sq();
  exp_avg.lerp_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  // Python keeps `step` in a float32 tensor and reads it back as a float.
  const double step = static_cast<double>(static_cast<float>(state.step()));
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  const torch::Tensor denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps);
  param.addcdiv_(exp_avg, denom, -step_size);
}

}  // namespace

Muon::Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults)
    : Optimizer(param_groups, std::make_unique<MuonOptions>(defaults)) {
  for (size_t i = 0; i < param_groups_.size(); ++i) check_group(param_groups_[i], i);
}

torch::Tensor Muon::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  const torch::Tensor loss = detail::evaluate_closure(closure);
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const MuonOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) slot = std::make_unique<MuonParamState>();
      auto& state = static_cast<MuonParamState&>(*slot);
      if (options.use_muon())
        muon_step(p, p.grad(), state, options, row_shards_ ? row_shards_(p) : nullptr);
      else
        adamw_step(p, p.grad(), state, options);
    }
  }
  return loss;
}

void Muon::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }
void Muon::load(torch::serialize::InputArchive& archive) { serialize(*this, archive); }

std::vector<torch::optim::OptimizerParamGroup> muon_param_groups(const torch::nn::Module& module, MuonOptions muon,
                                                                 MuonOptions adamw, const MuonSplit& split) {
  std::vector<torch::Tensor> to_muon, to_adamw;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    const bool excluded = std::any_of(split.adamw_names.begin(), split.adamw_names.end(), [&](const std::string& part) {
      return item.key().find(part) != std::string::npos;
    });
    (p.dim() == 2 && !excluded ? to_muon : to_adamw).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!to_muon.empty()) groups.emplace_back(std::move(to_muon), std::make_unique<MuonOptions>(muon.use_muon(true)));
  if (!to_adamw.empty()) groups.emplace_back(std::move(to_adamw), std::make_unique<MuonOptions>(adamw.use_muon(false)));
  return groups;
}

}  // namespace fulgur::optim
