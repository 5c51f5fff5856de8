// The emulated device's runtime: what a vendor's driver library provides for a real device, here
// over host memory. Shared by the three parts of the plugin: the runtime registrations
// (emu_runtime.cpp), the ATen kernels (emu_kernels.cpp) and the Fulgur accelerator
// (emulated_accelerator.cpp). A vendor replaces these functions with calls into its driver.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace emu {

/// The name the device gets in c10 (`emu:0`): c10::register_privateuse1_backend.
inline constexpr const char* kBackendName = "emu";
/// How many emulated devices the process sees (a real runtime asks its driver).
inline constexpr c10::DeviceIndex kDeviceCount = 2;

/// Registers the backend name and the PrivateUse1 hooks with libtorch, once per process; the
/// allocator, device guard, generator factory and kernels register themselves when the library
/// is loaded. Throws fulgur::Error when another backend already owns PrivateUse1.
void ensure_registered();

/// The calling thread's current device index (the device guard's state), 0 at first.
c10::DeviceIndex current_device();
/// Makes `index` the calling thread's current device; checks it exists.
void set_current_device(c10::DeviceIndex index);

/// The default generator of device `index` (-1: the current device); its state is the device's RNG
/// state, saved in checkpoints and restored by activation checkpointing.
const at::Generator& default_generator(c10::DeviceIndex index);
/// The CPU generator that draws the numbers for `generator` (an emulated-device generator): the
/// CPU kernels the fallback runs accept only a CPU generator.
at::Generator engine_of(const at::Generator& generator);

/// Bytes currently allocated on, and the most ever allocated on, device `index`.
struct MemoryStats {
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t allocations = 0;
};
MemoryStats memory_stats(c10::DeviceIndex index);

}  // namespace emu
