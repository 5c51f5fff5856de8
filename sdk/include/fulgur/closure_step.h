/// @file
/// Optimizers that re-evaluate the loss inside their step (torch::optim::LBFGS): the extension a
/// Precision offers when it can step them.
#pragma once

#include <fulgur/types.h>

#include <functional>
#include <string>
#include <string_view>

namespace fulgur {

/// Extension (SDK 1.2) of a Precision that can step an optimizer which calls a closure
/// (Lightning's `precision.optimizer_step(optimizer, closure)`). Under automatic optimization the
/// Trainer uses it for an optimizer that needs the closure (torch::optim::LBFGS): the closure runs
/// the Module's training_step under this precision's forward context, zeroes the gradients, runs
/// backward through the strategy, unscale_gradients, the on_before_optimizer_step hooks and
/// clipping, and returns the loss (detached; averaged over the ranks with several). Without this
/// extension, or with a non-empty closure_step_refusal(), such an optimizer is refused at the start
/// of fit with that reason. The strategy must delegate its step to the precision
/// (DeviceStepStrategy::delegates_optimizer_step); a strategy that shards or otherwise steps the
/// optimizer itself is refused as well.
class ClosureStepPrecision {
 public:
  /// The extension's id for Precision::extension().
  static constexpr std::string_view kExtensionId = "fulgur.precision.closure_step/1";
  /// Why this precision cannot step an optimizer that re-evaluates the loss (e.g. a loss scale
  /// that would have to be the same for every evaluation of one step), or "" when it can. Asked
  /// at the start of fit.
  virtual std::string closure_step_refusal() const = 0;
  /// `optimizer.step(closure)`; returns whether it stepped (false: skipped). Called once per
  /// optimizer step, in place of Precision::optimizer_step.
  virtual bool optimizer_step_with_closure(torch::optim::Optimizer& optimizer,
                                           const std::function<at::Tensor()>& closure) = 0;

 protected:
  ~ClosureStepPrecision() = default;
};

}  // namespace fulgur
