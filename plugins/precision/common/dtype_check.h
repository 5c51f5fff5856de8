// Setup-time check that a "true" precision's dtype has matmul kernels on the module's device
// (header-only, no plugin macros, so tests can drive it directly with device types this build of
// LibTorch has no kernels for).
#pragma once

#include <fulgur/error.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <string>
#include <string_view>

namespace fulgur::mixed_precision {

// Runs a 2x2 matmul in `dtype` on `device`; returns LibTorch's error text, empty when it works.
// Some CPU builds have no float16 matmul ("addmm_impl_cpu_" not implemented for 'Half'), some
// accelerators no float64 or bfloat16: probing is the only reliable answer.
inline std::string matmul_failure(c10::Device device, at::ScalarType dtype) {
  try {
    const at::Tensor a = at::ones({2, 2}, at::TensorOptions().dtype(dtype).device(device));
    (void)at::mm(a, a);
    return {};
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

// Throws fulgur::Error(config) naming the precision, the device and `alternatives` (what to put in
// `precision = ...` instead) when `dtype` cannot run a matmul on `device`: setup fails with a way
// out instead of the first forward failing deep inside a layer.
inline void require_matmul_support(std::string_view precision, c10::Device device, at::ScalarType dtype,
                                   std::string_view alternatives) {
  const std::string failure = matmul_failure(device, dtype);
  if (failure.empty()) return;
  // The first line of LibTorch's text is the reason; the rest lists dispatch keys.
  const std::string reason = failure.substr(0, failure.find('\n'));
  throw Error(ErrorKind::config, fmt::format("precision '{}' is not supported on device {}: a {} matmul fails there "
                                             "({}); use precision = {} instead",
                                             precision, device.str(), c10::toString(dtype), reason, alternatives));
}

}  // namespace fulgur::mixed_precision
