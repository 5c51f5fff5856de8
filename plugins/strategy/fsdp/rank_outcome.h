// What the split sharded saves (dcp_async.h, dcp_storage.h) share: running a step and keeping its
// error as text, learning every rank's text, and removing a directory without throwing.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <vector>

namespace fulgur::fsdp {

/// `value` sent by rank `src` to every rank (a collective; the identity in a single process).
using BroadcastString = std::function<std::string(const std::string& value, int64_t src)>;

/// The error message of `step`, empty when it succeeded.
template <class F>
std::string outcome(F&& step) {
  try {
    step();
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

/// Every rank's `mine`, in rank order (one broadcast per rank: small strings, few ranks).
inline std::vector<std::string> gather_strings(const std::string& mine, int64_t rank, int64_t world_size,
                                               const BroadcastString& broadcast) {
  std::vector<std::string> out;
  for (int64_t r = 0; r < world_size; ++r) out.push_back(broadcast(r == rank ? mine : std::string(), r));
  return out;
}

/// Removes `path` and everything below it; what cannot be removed stays (a cleanup, never an error).
inline void remove_tree(const std::filesystem::path& path) {
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
}

}  // namespace fulgur::fsdp
