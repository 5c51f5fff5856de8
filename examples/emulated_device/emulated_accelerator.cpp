// Accelerator `emulated`: the Fulgur side of the emulated device. It is what a TPU/NPU/custom
// device vendor writes to make its device selectable with `[trainer] accelerator = "..."`: the
// c10 device type its tensors carry, how `devices` maps to device indices, how a process makes
// its device current, the collective backend that fits, and statistics for monitoring. The
// device itself (allocator, guard, generator, kernels) is registered with libtorch by the rest of
// this library (emu_runtime.cpp, emu_kernels.cpp); the engine never names it.
#include <fulgur/plugin.h>

#include <cctype>
#include <string>

#include "emu_runtime.h"

namespace {

class EmulatedAccelerator final : public fulgur::Accelerator {
 public:
  // Registration with libtorch happens when the accelerator is created, not when the library is
  // loaded: `fulgur plugins list` may load it without claiming PrivateUse1 for it.
  EmulatedAccelerator() { emu::ensure_registered(); }

  c10::DeviceType device_type() const override { return c10::DeviceType::PrivateUse1; }
  bool is_available() const override { return true; }
  int64_t device_count() const override { return emu::kDeviceCount; }

  // "auto", "-1", "" -> every device; "N" -> the first N; "0,1" or "[1]" -> those indices.
  std::vector<c10::Device> parse_devices(std::string_view spec) const override {
    std::string s;
    for (char c : spec)
      if (!std::isspace(static_cast<unsigned char>(c)) && c != '[' && c != ']') s += c;
    std::vector<c10::Device> devices;
    auto add = [&](int64_t index) {
      if (index < 0 || index >= emu::kDeviceCount) refuse(spec);
      for (const auto& d : devices)
        if (d.index() == index) refuse(spec);
      devices.emplace_back(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index));
    };
    if (s.empty() || s == "auto" || s == "-1") {
      for (int64_t i = 0; i < emu::kDeviceCount; ++i) add(i);
      return devices;
    }
    try {
      if (s.find(',') == std::string::npos && spec.find('[') == std::string_view::npos) {
        size_t used = 0;
        const long n = std::stol(s, &used);
        if (used != s.size() || n < 1) refuse(spec);
        for (long i = 0; i < n; ++i) add(i);
        return devices;
      }
      size_t start = 0;
      while (start < s.size()) {
        const size_t comma = s.find(',', start);
        const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        size_t used = 0;
        const long index = std::stol(item, &used);
        if (used != item.size()) refuse(spec);
        add(index);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } catch (const std::logic_error&) {  // std::stol: not a number
      refuse(spec);
    }
    if (devices.empty()) refuse(spec);
    return devices;
  }

  // VENDOR: select the device in the driver (cudaSetDevice, ...) before anything allocates.
  void setup_device(const c10::Device& device) override {
    if (device.type() != c10::DeviceType::PrivateUse1 || device.index() >= emu::kDeviceCount)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "accelerator 'emulated': cannot set up device " + device.str() + "; it offers " + offered());
    emu::set_current_device(device.index() < 0 ? 0 : device.index());
  }

  // Gloo moves CPU tensors only; the engine stages this device's tensors through host memory.
  // VENDOR: a device with its own collective library names its c10d backend here.
  std::string default_collective_backend() const override { return "gloo"; }

  // Kernels run synchronously on the calling thread: nothing is ever queued.
  void synchronize(const c10::Device&) override {}

  fulgur::MetricMap device_stats(const c10::Device& device) const override {
    const emu::MemoryStats stats = emu::memory_stats(device.index() < 0 ? emu::current_device() : device.index());
    return {{"allocated_bytes.all.current", static_cast<double>(stats.allocated)},
            {"allocated_bytes.all.peak", static_cast<double>(stats.peak)},
            {"allocations", static_cast<double>(stats.allocations)}};
  }

  std::string device_name(const c10::Device& device) const override {
    return "Fulgur emulated device " + device.str() + " (host memory)";
  }

 private:
  [[noreturn]] static void refuse(std::string_view spec) {
    throw fulgur::Error(fulgur::ErrorKind::config, "accelerator 'emulated': devices = \"" + std::string(spec) +
                                                       "\" is not understood; use a count from 1 to " +
                                                       std::to_string(emu::kDeviceCount) +
                                                       ", \"auto\", or indices such as \"0,1\" (" + offered() + ")");
  }
  static std::string offered() {
    return std::to_string(emu::kDeviceCount) + " devices: " + emu::kBackendName + ":0.." +
           std::to_string(emu::kDeviceCount - 1);
  }
};

}  // namespace

FULGUR_PLUGIN(EmulatedAccelerator, "emulated", "1.0.0",
              "An emulated accelerator over host memory (PrivateUse1 open registration): the device vendor's template")
