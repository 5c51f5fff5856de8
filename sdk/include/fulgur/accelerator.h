// Accelerator: where tensors live and compute runs (cpu, cuda, ...).
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <c10/core/Device.h>

#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

class FULGUR_SDK_API Accelerator {
 public:
  virtual ~Accelerator();

  virtual c10::DeviceType device_type() const = 0;
  virtual bool is_available() const = 0;
  virtual int64_t device_count() const = 0;
  // Parses the Trainer's `devices` setting: "auto", "N" (count), "-1" (all), "0,2" (indices).
  // Throws fulgur::Error(config) naming the spec and what this accelerator offers.
  virtual std::vector<c10::Device> parse_devices(std::string_view spec) const = 0;
  // Makes `device` current for this process (cuda: set_device); called once before setup.
  virtual void setup_device(const c10::Device& device) = 0;
  // The c10d backend that fits this device type: "gloo" or "nccl".
  virtual std::string default_collective_backend() const = 0;
  // Waits for queued work on `device` (a no-op on cpu).
  virtual void synchronize(const c10::Device& device) = 0;
  // Point-in-time statistics for monitoring callbacks (memory, utilisation), keyed by metric name.
  virtual MetricMap device_stats(const c10::Device& device) const = 0;
  virtual void teardown() {}
};

}  // namespace fulgur
