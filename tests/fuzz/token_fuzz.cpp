// Fuzz target: the token file reader of the GPT example (a memory-mapped array of uint16 or
// uint32 ids as language-model windows). The first 4 bytes pick the options (dtype, block size,
// stride, vocabulary size, skip_corrupt); the rest is the file.
#include <fulgur/data/token_file.h>
#include <fulgur/error.h>

#include <algorithm>

#include "fuzz_targets.h"
#include "memory_file.h"

namespace fulgur::fuzz {

int token(const uint8_t* data, size_t size) {
  static MemoryFile file("fulgur-fuzz-token");
  if (size < 4) return 0;
  const bool skip_corrupt = data[0] & 2;
  data::TokenFileOptions options(data[1] & 63);  // 0 included: an invalid block size
  options.dtype((data[0] & 1) ? data::TokenType::uint32 : data::TokenType::uint16)
      .skip_corrupt(skip_corrupt)
      .stride(data[2] & 15)
      .vocab_size(int64_t{data[3]} * 64);
  try {
    data::TokenFile tokens(file.set(data + 4, size - 4), options);
    const int64_t n = tokens.size();
    for (int64_t i = 0; i < std::min<int64_t>(n, 256); ++i) {
      try {
        data::Sample s = tokens.get(i);
        (void)s.input.numel();
      } catch (const data::SkipSample&) {
        if (!skip_corrupt) throw;
      }
    }
    if (n > 256) {
      try {
        (void)tokens.get(n - 1);
      } catch (const data::SkipSample&) {
        if (!skip_corrupt) throw;
      }
    }
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::token)
