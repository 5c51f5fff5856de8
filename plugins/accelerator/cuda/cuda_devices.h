// The `devices` setting of the `cuda` accelerator, parsed the way Lightning's CUDAAccelerator
// accepts it, as a pure function of the spec and the number of visible devices (no CUDA calls), so
// tests can run it with any device count.
//
//   "auto", "-1", ""         every visible device (0 .. count-1)
//   "N" (N >= 1)             the first N devices (0 .. N-1)
//   "0,2", "0, 2", "[0, 2]"  those indices (TOML `devices = [0, 2]` arrives as "0,2"); a trailing
//                            comma ("1,") means the one index, as in Lightning's "1,"
//
// Indices are into the devices this process sees: CUDA_VISIBLE_DEVICES has already renumbered
// them. Refusals throw fulgur::Error(config) with one line that says what is wrong and what to set.
#pragma once

#include <fulgur/error.h>

#include <fmt/format.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur::cuda_accelerator {

// Why no device can be used, for the one-line refusal: `count` devices seen by torch and the
// CUDA_VISIBLE_DEVICES value (nullptr when unset).
inline std::string no_device_message(int64_t count, const char* visible) {
  return fmt::format(
      "accelerator 'cuda': no CUDA device is visible (torch sees {}; CUDA_VISIBLE_DEVICES={}); use accelerator = "
      "\"cpu\" or run on a GPU machine",
      count, visible ? fmt::format("\"{}\"", visible) : std::string("<unset>"));
}

namespace detail {

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// A whole non-negative or negative decimal integer, or false.
inline bool parse_int(std::string_view s, int64_t& out) {
  s = trim(s);
  if (s.empty() || s.size() > 18) return false;
  size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
    v = v * 10 + (s[i] - '0');
  }
  out = s[0] == '-' ? -v : v;
  return true;
}

[[noreturn]] inline void malformed(std::string_view spec, int64_t count) {
  throw Error(ErrorKind::config,
              fmt::format("accelerator 'cuda': devices = \"{}\" is not understood; use a count such as 1, \"auto\", "
                          "-1 (all), or device indices such as \"0,1\" or [0, 1] ({} device(s) visible: 0..{})",
                          spec, count, count - 1));
}

}  // namespace detail

// The device indices `spec` selects among `count` visible devices; throws fulgur::Error(config).
inline std::vector<int64_t> parse_cuda_devices(std::string_view spec, int64_t count, const char* visible = nullptr) {
  const std::string_view s = detail::trim(spec);
  if (count <= 0) throw Error(ErrorKind::config, no_device_message(count, visible));
  std::vector<int64_t> indices;
  if (s.empty() || s == "auto" || s == "-1") {
    for (int64_t i = 0; i < count; ++i) indices.push_back(i);
    return indices;
  }
  int64_t n = 0;
  if (detail::parse_int(s, n)) {
    if (n == 0 || n < -1)
      throw Error(ErrorKind::config,
                  fmt::format("accelerator 'cuda': devices = {} selects no device; use a count from 1 to {}, \"auto\" "
                              "or -1 (all)",
                              n, count));
    if (n > count)
      throw Error(ErrorKind::config,
                  fmt::format("accelerator 'cuda': devices = {} asks for {} devices, but only {} {} visible; set "
                              "devices to at most {} (or \"auto\"), or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
                              n, n, count, count == 1 ? "is" : "are", count));
    for (int64_t i = 0; i < n; ++i) indices.push_back(i);
    return indices;
  }
  // An index list: "0,2", "1,", "[0, 2]".
  std::string_view list = s;
  if (!list.empty() && list.front() == '[') {
    if (list.back() != ']') detail::malformed(spec, count);
    list = detail::trim(list.substr(1, list.size() - 2));
  }
  if (list.find(',') == std::string_view::npos && s.front() != '[') detail::malformed(spec, count);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string_view item =
        detail::trim(list.substr(start, comma == std::string_view::npos ? list.npos : comma - start));
    const bool last = comma == std::string_view::npos;
    if (item.empty()) {
      // Only a trailing comma may leave an empty item ("1,"), and only after one index at least.
      if (!(last && !indices.empty())) detail::malformed(spec, count);
      break;
    }
    int64_t index = 0;
    if (!detail::parse_int(item, index) || index < 0) detail::malformed(spec, count);
    if (index >= count)
      throw Error(ErrorKind::config,
                  fmt::format("accelerator 'cuda': devices = \"{}\" names device {}, but only {} {} visible "
                              "(indices 0..{}); use indices below {}, or check CUDA_VISIBLE_DEVICES",
                              spec, index, count, count == 1 ? "is" : "are", count - 1, count));
    for (int64_t seen : indices)
      if (seen == index)
        throw Error(ErrorKind::config,
                    fmt::format("accelerator 'cuda': devices = \"{}\" names device {} twice; list each index once",
                                spec, index));
    indices.push_back(index);
    if (last) break;
    start = comma + 1;
  }
  if (indices.empty()) detail::malformed(spec, count);
  return indices;
}

}  // namespace fulgur::cuda_accelerator
