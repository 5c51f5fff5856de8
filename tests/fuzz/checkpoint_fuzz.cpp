// Fuzz target: the checkpoint reader (zip framing check, then torch's archive reader and
// unpickler) on arbitrary bytes, through an in-memory file.
#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>

#include <ATen/core/ivalue.h>

#include "fuzz_targets.h"
#include "memory_file.h"

namespace fulgur::fuzz {

int checkpoint(const uint8_t* data, size_t size) {
  static MemoryFile file("fulgur-fuzz-checkpoint");
  try {
    c10::IValue value = read_checkpoint_file(file.set(data, size), c10::Device(c10::kCPU));
    (void)value.isGenericDict();
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::checkpoint)
