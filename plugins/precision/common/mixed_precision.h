// Pieces shared by the built-in precision plugins (header-only, so each plugin stays a single
// translation unit built against sdk/ only): gradients of an optimizer, Lightning's clipping,
// an autocast scope that mirrors Python's torch.autocast, and dtype conversion of modules/batches.
#pragma once

#include <fulgur/closure_step.h>
#include <fulgur/plugin.h>

#include <ATen/TensorOperators.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Dict.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <ATen/ops/stack.h>
#include <c10/core/DefaultDtype.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace fulgur::mixed_precision {

// ClosureStepPrecision for a precision that never scales the loss nor skips a step: the closure's
// loss and gradients are true values, so the optimizer (LBFGS) is stepped as it is in Python.
class PlainClosureStep : public ClosureStepPrecision {
 public:
  std::string closure_step_refusal() const override { return {}; }
  bool optimizer_step_with_closure(torch::optim::Optimizer& optimizer,
                                   const std::function<at::Tensor()>& closure) override {
    optimizer.step(closure);
    return true;
  }
};

// Gradients of every parameter the optimizer updates; parameters without a gradient (frozen, or
// unused in this step) are skipped, as torch.nn.utils.clip_grad_* do.
inline std::vector<at::Tensor> gradients_of(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (const at::Tensor& param : group.params())
      if (param.grad().defined()) grads.push_back(param.grad());
  return grads;
}

// The device of the module's first parameter (then buffer); CPU for a module without any. The
// Trainer calls convert_module after the strategy has moved the module to its device.
inline c10::Device device_of(torch::nn::Module& module) {
  for (const at::Tensor& p : module.parameters()) return p.device();
  for (const at::Tensor& b : module.buffers()) return b.device();
  return c10::Device(c10::DeviceType::CPU);
}
inline c10::DeviceType device_type_of(torch::nn::Module& module) { return device_of(module).type(); }

// Python's torch.autocast(device_type, dtype) as enter/exit calls: saves the previous enabled
// flag and dtype, enables autocast and increments the nesting; on exit restores them and clears
// the cast cache when the outermost autocast region ends. Nested scopes are kept on a stack.
class AutocastState {
 public:
  void enter(c10::DeviceType device_type, at::ScalarType dtype) {
    saved_.push_back(
        {device_type, at::autocast::is_autocast_enabled(device_type), at::autocast::get_autocast_dtype(device_type)});
    at::autocast::set_autocast_enabled(device_type, true);
    at::autocast::set_autocast_dtype(device_type, dtype);
    at::autocast::increment_nesting();
  }

  void exit() {
    if (saved_.empty()) return;
    const Saved saved = saved_.back();
    saved_.pop_back();
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(saved.device_type, saved.enabled);
    at::autocast::set_autocast_dtype(saved.device_type, saved.dtype);
  }

 private:
  struct Saved {
    c10::DeviceType device_type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Saved> saved_;
};

// Lightning's _DtypeContextManager: the default dtype during the forward pass of a "true" mode,
// so that tensors a model creates inside forward() match its parameters.
class DefaultDtypeState {
 public:
  void enter(at::ScalarType dtype) {
    saved_.push_back(c10::get_default_dtype());
    c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(dtype));
  }
  void exit() {
    if (saved_.empty()) return;
    c10::set_default_dtype(saved_.back());
    saved_.pop_back();
  }

 private:
  std::vector<caffe2::TypeMeta> saved_;
};

// Python's module.to(dtype): floating-point parameters and buffers only (libtorch's
// Module::to(dtype) would also convert integer buffers such as BatchNorm's num_batches_tracked).
// set_data keeps each tensor's identity, so optimizers built before still hold the same params.
inline void convert_floating(torch::nn::Module& module, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (at::Tensor& p : module.parameters())
    if (p.is_floating_point() && p.scalar_type() != dtype) {
      p.set_data(p.to(dtype));
      if (p.grad().defined()) p.mutable_grad() = p.grad().to(dtype);
    }
  for (at::Tensor& b : module.buffers())
    if (b.is_floating_point() && b.scalar_type() != dtype) b.set_data(b.to(dtype));
}

inline void convert_tensor(at::Tensor& t, at::ScalarType dtype) {
  if (t.defined() && t.is_floating_point() && t.scalar_type() != dtype) t = t.to(dtype);
}

inline void convert_batch(Batch& batch, at::ScalarType dtype) {
  convert_tensor(batch.input, dtype);
  convert_tensor(batch.target, dtype);
  for (at::Tensor& t : batch.extra) convert_tensor(t, dtype);
}

inline c10::impl::GenericDict empty_state() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

// Stateless plugins: accept None or an empty dict; warn (not fail) on a scaler state saved by
// another plugin.
inline void load_stateless(std::string_view plugin, const c10::IValue& state) {
  if (state.isNone()) return;
  if (!state.isGenericDict())
    throw Error(ErrorKind::checkpoint, fmt::format("precision '{}': the checkpoint's precision state is a {}, "
                                                   "expected a dict",
                                                   plugin, state.tagKind()));
  const c10::impl::GenericDict dict = state.toGenericDict();
  if (dict.empty()) return;
  std::vector<std::string> keys;
  for (const auto& entry : dict) keys.push_back(entry.key().isString() ? entry.key().toStringRef() : "?");
  fulgur::log::warn(
      fmt::format("precision '{}' ignores the precision state in the checkpoint (keys: {}); it was saved by "
                  "another precision plugin",
                  plugin, fmt::join(keys, ", ")));
}

}  // namespace fulgur::mixed_precision
