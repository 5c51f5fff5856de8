// The closure an optimizer's step() may be given, evaluated as torch::optim's own optimizers do.
#pragma once

#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

namespace fulgur::optim::detail {

// Runs `closure` with gradients enabled (step() itself runs under no_grad) and returns its loss,
// or an undefined tensor when there is none.
inline torch::Tensor evaluate_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace fulgur::optim::detail
