// `fulgur checkpoint consolidate DIR OUT` and `fulgur checkpoint inspect DIR` on top of
// fulgur/distributed_checkpoint.h: a sharded checkpoint (one file per writer rank) becomes one
// torch.save file that a single process, Python's torch.load or `fulgur weights` opens.
#include "checkpoint_command.h"

#include "storage_paths.h"

#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>

#include <c10/core/ScalarType.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

namespace fulgur::cli {

namespace {

constexpr const char* kCheckpointUsage =
    "usage:\n"
    "  fulgur checkpoint consolidate DIR OUT   (a distributed checkpoint directory into one torch.save file)\n"
    "  fulgur checkpoint inspect DIR           (keys, dtypes, shapes and writer files)\n"
    "DIR and OUT may be s3:// URLs; --config FILE takes [storage] (endpoint, profile...) from a run's TOML.\n";

// DIR and OUT may be s3:// URLs (storage_paths.h).
int consolidate(const std::string& dir, const std::string& out) {
  const LocalInput input(dir);
  LocalOutput output(out);
  dcp::consolidate(input.path(), output.path());
  const auto bytes = std::filesystem::file_size(output.path());
  output.publish();
  std::cout << fmt::format("wrote {} ({} bytes) from {}\n", out, bytes, dir);
  return 0;
}

int inspect(const std::string& shown) {
  const LocalInput input(shown);
  const std::string& dir = input.path();
  const dcp::Reader reader(dir);
  const std::vector<std::string> keys = reader.keys();
  size_t width = 4;  // the names' column, up to 64 characters (longer names push their row only)
  for (const auto& k : keys) width = std::max(width, std::min<size_t>(k.size(), 64));
  int64_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().extension() == ".distcp") ++files;
  std::cout << fmt::format("{}: distributed checkpoint, {} entries, {} data files\n", shown, keys.size(), files);
  for (const auto& k : keys) {
    if (reader.is_tensor(k))
      std::cout << fmt::format("{:<{}}  {:<9} [{}]\n", k, width, c10::toString(reader.dtype(k)),
                               fmt::join(reader.shape(k), ", "));
    else
      std::cout << fmt::format("{:<{}}  value\n", k, width);
  }
  return 0;
}

}  // namespace

int checkpoint_main(const std::vector<std::string>& p) {
  if (p.size() == 4 && p[1] == "consolidate") return consolidate(p[2], p[3]);
  if (p.size() == 3 && p[1] == "inspect") return inspect(p[2]);
  std::cerr << kCheckpointUsage;
  return 2;
}

}  // namespace fulgur::cli
