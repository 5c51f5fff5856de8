// Fuzz target: the safetensors reader (header length, JSON header, dtypes, shapes, offsets) on
// arbitrary bytes, through an in-memory file.
#include <fulgur/error.h>
#include <fulgur/weights.h>

#include "fuzz_targets.h"
#include "memory_file.h"

namespace fulgur::fuzz {

int safetensors(const uint8_t* data, size_t size) {
  static MemoryFile file("fulgur-fuzz-safetensors");
  try {
    (void)read_safetensors(file.set(data, size));
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::safetensors)
