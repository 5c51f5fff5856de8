// Fuzz target: the IDX reader of the Fashion-MNIST example (plain or gzip input; the first byte
// picks the expected number of dimensions, 1 for labels or 3 for images).
#include <fulgur/error.h>

#include <ATen/core/Tensor.h>

#include "fashion_mnist.h"
#include "fuzz_targets.h"
#include "memory_file.h"

namespace fulgur::fuzz {

int idx(const uint8_t* data, size_t size) {
  static MemoryFile file("fulgur-fuzz-idx");
  if (size == 0) return 0;
  const int64_t dims = (data[0] & 1) ? 3 : 1;
  try {
    at::Tensor t = examples::read_idx(file.set(data + 1, size - 1), dims);
    (void)t.numel();
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::idx)
