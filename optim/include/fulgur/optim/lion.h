// Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023): the sign of an
// interpolated momentum, one state buffer per parameter. Elementwise, so sharded (ZeRO) optimizer
// state needs nothing special. Step for step equal to lucidrains' lion-pytorch 0.2.5 `Lion`.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <vector>

namespace fulgur::optim {

/// Hyperparameters of one Lion parameter group (chained setters, as torch::optim::AdamWOptions).
struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  LionOptions(double lr = 1e-4);
  using betas_t = std::tuple<double, double>;
  /// Step size. Lion's update has unit magnitude per element: use ~3-10x less than AdamW's lr.
  TORCH_ARG(double, lr) = 1e-4;
  /// beta1 interpolates the update direction, beta2 the momentum kept for the next step.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  /// Decoupled weight decay: p *= 1 - lr * weight_decay before the update.
  TORCH_ARG(double, weight_decay) = 0.0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const LionOptions& lhs, const LionOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state: the momentum (lion-pytorch's and Python's state dict key `exp_avg`).
struct LionParamState : public torch::optim::OptimizerCloneableParamState<LionParamState> {
  TORCH_ARG(torch::Tensor, exp_avg);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const LionParamState& lhs, const LionParamState& rhs);
};

/// c = b1*m + (1-b1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = b2*m + (1-b2)*g.
class Lion : public torch::optim::Optimizer {
 public:
  explicit Lion(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LionOptions defaults = {});
  explicit Lion(std::vector<torch::Tensor> params, LionOptions defaults = {})
      : Lion({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  /// One step over every parameter with a gradient; runs `closure` first (under grad mode) if given.
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    torch::optim::serialize<LionParamState, LionOptions>(archive, self);
  }
};

}  // namespace fulgur::optim
