#include "device_rng.h"

#include <fulgur/accelerator.h>

#include <ATen/Context.h>
#include <c10/core/DeviceType.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <mutex>
#include <optional>

#include "ivalue_dict.h"

namespace fulgur {

namespace {

// The default generator of `device`, or none where the device is the CPU (saved on its own) or
// its backend has no generator (meta, a backend whose hooks do not offer one).
std::optional<at::Generator> device_generator(c10::Device device) {
  if (device.is_cpu() || device.is_meta()) return std::nullopt;
  try {
    return at::globalContext().defaultGenerator(device);
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

}  // namespace

void seed_device_generators(const Accelerator& accelerator, uint64_t seed) {
  const c10::DeviceType type = accelerator.device_type();
  if (type == c10::DeviceType::CPU || !accelerator.is_available()) return;
  for (int64_t i = 0; i < accelerator.device_count(); ++i) {
    std::optional<at::Generator> generator = device_generator(c10::Device(type, static_cast<c10::DeviceIndex>(i)));
    if (!generator) return;
    std::lock_guard<std::mutex> lock(generator->mutex());
    generator->set_current_seed(seed);
  }
}

void save_device_rng_state(c10::impl::GenericDict& state, c10::Device device) {
  std::optional<at::Generator> generator = device_generator(device);
  if (!generator) return;
  std::lock_guard<std::mutex> lock(generator->mutex());
  state.insert("device_rng_state", generator->get_state());
  state.insert("device_rng_device_type", c10::DeviceTypeName(device.type(), /*lower_case=*/true));
}

void load_device_rng_state(const c10::impl::GenericDict& state, c10::Device device, const std::string& path) {
  const std::optional<c10::IValue> saved = detail::get(state, "device_rng_state");
  if (!saved) return;
  const std::optional<c10::IValue> type = detail::get(state, "device_rng_device_type");
  const std::string saved_type = type && type->isString() ? type->toStringRef() : std::string("?");
  const std::string here = c10::DeviceTypeName(device.type(), /*lower_case=*/true);
  std::optional<at::Generator> generator = device_generator(device);
  if (!generator || saved_type != here || !saved->isTensor()) {
    spdlog::warn(
        "{}: the checkpoint holds the random state of a {} device; this run trains on {}, so that state is "
        "not restored (random draws on the device will differ from the interrupted run)",
        path, saved_type, device.str());
    return;
  }
  std::lock_guard<std::mutex> lock(generator->mutex());
  generator->set_state(saved->toTensor());
}

}  // namespace fulgur
