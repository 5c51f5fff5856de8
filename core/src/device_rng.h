// Internal: the random state of the training device's default generator, for any device type
// whose backend has one (cuda, xpu, a PrivateUse1 backend such as the emulated device): seeded
// with [trainer] seed, saved in checkpoints next to the CPU generator's, restored on resume.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace fulgur {

class Accelerator;

/// Seeds the default generator of every device of the accelerator's type (the CPU's is seeded by
/// torch::manual_seed; that one reaches a plugin backend only when it was registered by then).
void seed_device_generators(const Accelerator& accelerator, uint64_t seed);

/// Puts `device`'s generator state into a loop's state dict ("device_rng_state", and the device
/// type it belongs to) when `device` is not the CPU and its backend has a generator.
void save_device_rng_state(c10::impl::GenericDict& state, c10::Device device);

/// Restores what save_device_rng_state put into `state` onto `device`'s generator; nothing when
/// the checkpoint has none (CPU runs, older checkpoints). A state saved on another device type is
/// skipped with a warning (resuming a GPU run on the CPU, say).
void load_device_rng_state(const c10::impl::GenericDict& state, c10::Device device, const std::string& path);

}  // namespace fulgur
