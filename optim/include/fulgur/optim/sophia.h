// SophiaG (Liu et al., "Sophia: A Scalable Stochastic Second-order Optimizer for Language Model
// Pre-training", 2023; github.com/Liuhong99/Sophia sophia.py): a sign-like update whose size per
// element is the momentum over an EMA of a diagonal Hessian estimate, clipped to 1:
//
//   m = b1*m + (1-b1)*g;   p *= 1 - lr*wd;   p -= lr * sign(m) * min(|m| / (max(rho*bs*h, 0) + 1e-15), 1)
//
// The Hessian EMA h is refreshed every k steps (the paper's k = 10), not by step() but by
// update_hessian(), from the gradient of an extra backward pass: for the Gauss-Newton-Bartlett
// estimator, the loss of the model's own logits against labels sampled from them
// (gnb_sampled_labels), so h = b2*h + (1-b2)*g_hat^2 where g_hat is that pass's mean gradient and bs
// the number of samples it averaged over (`bs`). refresh_hessian() runs that pass;
// refresh_hessian_hutchinson() is the Hutchinson estimator (u * Hu with Gaussian u).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <functional>
#include <tuple>
#include <vector>

namespace fulgur::optim {

/// Hyperparameters of one SophiaG parameter group (defaults are sophia.py's SophiaG's).
struct SophiaGOptions : public torch::optim::OptimizerCloneableOptions<SophiaGOptions> {
  SophiaGOptions(double lr = 1e-4);
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(double, lr) = 1e-4;
  /// beta1: the gradient's EMA; beta2: the Hessian estimate's EMA.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.965, 0.99);
  /// The clipping threshold's scale: the update is clipped where |m| > rho * bs * h.
  TORCH_ARG(double, rho) = 0.04;
  TORCH_ARG(double, weight_decay) = 1e-1;
  /// Tokens (samples) per Hessian-estimate batch, which scales the GNB estimate (sophia.py's
  /// step(bs=5120) argument, here an option so that checkpoints keep it).
  TORCH_ARG(int64_t, bs) = 5120;
  TORCH_ARG(bool, maximize) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const SophiaGOptions& lhs, const SophiaGOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state: step, exp_avg (m) and hessian (h), sophia.py's keys.
struct SophiaGParamState : public torch::optim::OptimizerCloneableParamState<SophiaGParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, hessian);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const SophiaGParamState& lhs, const SophiaGParamState& rhs);
};

class SophiaG : public torch::optim::Optimizer {
 public:
  explicit SophiaG(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SophiaGOptions defaults = {});
  explicit SophiaG(std::vector<torch::Tensor> params, SophiaGOptions defaults = {})
      : SophiaG({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  /// The clipped update of every parameter with a gradient; the Hessian estimate is not touched.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// h = b2*h + (1-b2) * grad * grad for every parameter with a gradient: call it right after the
  /// backward pass of the estimator's loss (sophia.py's update_hessian).
  void update_hessian();
  /// The Hessian refresh in one call: zeroes the gradients, runs backward on `sampled_loss()`
  /// (e.g. cross_entropy(logits, gnb_sampled_labels(logits))), update_hessian(), zeroes the
  /// gradients again. Call it every k steps, after step() (see the loop hook in the report).
  void refresh_hessian(const std::function<torch::Tensor()>& sampled_loss);
  /// The Hutchinson refresh (the paper's Sophia-H): with L = `loss()` (the training loss of a
  /// batch) and u ~ N(0, I) drawn per parameter from the default generator (randn_like, in
  /// param-group order), h = b2*h + (1-b2) * u * (H u), where H u is the Hessian-vector product
  /// grad(<grad L, u>) of a double backward. Every parameter that requires grad takes part;
  /// gradients are left zeroed. The paper's clipping divides by rho * h alone: use bs(1) with it.
  /// Call it every k steps, after step(), e.g. from the Module's on_train_batch_end with the batch.
  void refresh_hessian_hutchinson(const std::function<torch::Tensor()>& loss);
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    torch::optim::serialize<SophiaGParamState, SophiaGOptions>(archive, self);
  }
};

/// Labels drawn from the model's own predictive distribution, one per row of `logits` [..., C]:
/// torch.multinomial(softmax(logits, -1), 1, replacement=True) on the default generator, so the
/// draw follows torch.manual_seed like Python's. No gradient flows through them.
torch::Tensor gnb_sampled_labels(const torch::Tensor& logits);

}  // namespace fulgur::optim
