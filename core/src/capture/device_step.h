// The Trainer's view of the optional device-step extensions (DeviceStepStrategy,
// DeviceStepPrecision): what a plugin without them means, in one place.
#pragma once

#include <fulgur/precision.h>
#include <fulgur/strategy.h>

#include <ATen/core/Tensor.h>

#include <string>

#include "../connectors/plugin_connector.h"

namespace fulgur {

/// Whether the strategy lets the Trainer take the optimizer step itself; false without the
/// strategy's DeviceStepStrategy extension.
inline bool delegates_optimizer_step(const PluginSet& plugins) {
  return plugins.strategy_device_step && plugins.strategy_device_step->delegates_optimizer_step();
}

/// The precision's inf/NaN flag for this step, computed on the device; undefined without the
/// precision's DeviceStepPrecision extension (the step is decided on the host).
inline at::Tensor device_found_inf(const PluginSet& plugins, torch::optim::Optimizer& optimizer) {
  return plugins.precision_device_step ? plugins.precision_device_step->device_found_inf(optimizer) : at::Tensor();
}

/// Why the strategy's steps cannot be captured ("" when they can).
inline std::string strategy_capture_refusal(const PluginSet& plugins) {
  return plugins.strategy_device_step ? plugins.strategy_device_step->step_capture_refusal()
                                      : "the strategy plugin does not declare that its steps can be captured (it "
                                        "does not implement the DeviceStepStrategy extension)";
}

/// Why the precision's steps cannot be captured ("" when they can).
inline std::string precision_capture_refusal(const PluginSet& plugins) {
  return plugins.precision_device_step ? plugins.precision_device_step->step_capture_refusal()
                                       : "the precision plugin does not declare that its steps can be captured (it "
                                         "does not implement the DeviceStepPrecision extension)";
}

}  // namespace fulgur
