// Fuzz target: the distributed checkpoint reader, whose `.metadata` is a Python pickle of DCP's
// Metadata dataclass decoded by Fulgur's own unpickler. The input is the metadata and one data
// file: a 4-byte little-endian length, that many bytes of `.metadata`, then `__0_0.distcp` (the
// name Fulgur's and Python's writers give rank 0's file). A checkpoint that opens is read whole.
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>

#include <ATen/core/ivalue.h>

#include <algorithm>

#include "fuzz_targets.h"
#include "scratch_dir.h"

namespace fulgur::fuzz {

int dcp_metadata(const uint8_t* data, size_t size) {
  static ScratchDir dir("fulgur-fuzz-dcp");
  if (size < 4) return 0;
  const size_t declared = data[0] | (size_t{data[1]} << 8) | (size_t{data[2]} << 16) | (size_t{data[3]} << 24);
  const size_t metadata = std::min(declared, size - 4);
  dir.write(".metadata", data + 4, metadata);
  dir.write("__0_0.distcp", data + 4 + metadata, size - 4 - metadata);
  try {
    dcp::Reader reader(dir.root().string());
    for (const std::string& key : reader.keys()) {
      (void)reader.path(key);
      if (reader.is_tensor(key)) {
        (void)reader.shape(key);
        (void)reader.dtype(key);
      }
    }
    c10::IValue all = reader.read_all();
    (void)all.isGenericDict();
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::dcp_metadata)
