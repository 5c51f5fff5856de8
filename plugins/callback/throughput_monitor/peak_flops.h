// Peak dense FLOP/s of common datacenter GPUs per compute dtype, for throughput_monitor's MFU when
// `peak_flops` is not given. Figures are NVIDIA's datasheet numbers without structured sparsity
// (the datasheets print tensor-core figures "with sparsity"; those are halved here). FP8 is the
// `fp8` precision's compute dtype (Float8_e4m3fn); Ampere and Volta have no FP8 tensor cores. Matched on
// the name the driver reports (cudaDeviceProp::name, e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3",
// "NVIDIA A100-SXM4-80GB"), lower-cased, first matching row wins: the more specific names first.
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <string_view>

namespace fulgur::throughput {

struct PeakFlops {
  std::string_view name_contains;       // lower case
  double fp64, fp32, tf32, bf16, fp16, fp8;  // 0: not published (fp8: e4m3 dense tensor cores)
};

// clang-format off
inline constexpr PeakFlops kPeakFlopsTable[] = {
    // Hopper
    {"gh200",     67e12,   67e12,   494.7e12, 989.4e12, 989.4e12, 1978.9e12},
    {"h200 nvl",  60e12,   60e12,   417.5e12, 835.5e12, 835.5e12, 1670.5e12},
    {"h200",      67e12,   67e12,   494.7e12, 989.4e12, 989.4e12, 1978.9e12},  // H200 SXM
    {"h100 nvl",  60e12,   60e12,   417.5e12, 835.5e12, 835.5e12, 1670.5e12},
    {"h100 pcie", 51e12,   51e12,   378e12,   756e12,   756e12, 1513e12},
    {"h100",      67e12,   67e12,   494.7e12, 989.4e12, 989.4e12, 1978.9e12},  // H100 SXM ("H100 80GB HBM3")
    // Ada
    {"l40s",      0,       91.6e12, 183e12,   362.05e12, 362.05e12, 733e12},
    {"l40",       0,       90.5e12, 90.5e12,  181e12,   181e12, 362e12},
    {"l4",        0,       30.3e12, 60e12,    121e12,   121e12, 242.5e12},
    // Ampere
    {"a100",      19.5e12, 19.5e12, 156e12,   312e12,   312e12, 0},
    // Volta: no bf16 or tf32 tensor cores, so those run at the fp32 rate
    {"v100",      7.8e12,  15.7e12, 15.7e12,  15.7e12,  125e12, 0},
};
// clang-format on

// The peak FLOP/s of `device_name` for `dtype` (float32 counts as TF32 when `tf32` allows it), or
// nullopt for a device or dtype the table does not know.
inline std::optional<double> peak_flops_for(std::string_view device_name, c10::ScalarType dtype, bool tf32) {
  std::string name(device_name);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const PeakFlops& row : kPeakFlopsTable) {
    if (name.find(row.name_contains) == std::string::npos) continue;
    switch (dtype) {
      case c10::ScalarType::Double:
        return row.fp64 > 0 ? std::optional<double>(row.fp64) : std::nullopt;
      case c10::ScalarType::Float:
        return tf32 ? row.tf32 : row.fp32;
      case c10::ScalarType::BFloat16:
        return row.bf16;
      case c10::ScalarType::Half:
        return row.fp16;
      case c10::ScalarType::Float8_e4m3fn:
        return row.fp8 > 0 ? std::optional<double>(row.fp8) : std::nullopt;
      default:
        return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace fulgur::throughput
