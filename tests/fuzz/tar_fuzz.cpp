// Fuzz target: the WebDataset tar shard reader (ustar, pax and GNU long names, checksums, member
// grouping, .cls targets) on one shard: a full pass, then a pass of one of two replicas that skips
// ahead first. The first byte picks the options.
#include <fulgur/data/tar_shards.h>
#include <fulgur/error.h>

#include "fuzz_targets.h"
#include "memory_file.h"

namespace fulgur::fuzz {

int tar(const uint8_t* data, size_t size) {
  static MemoryFile file("fulgur-fuzz-tar");
  if (size == 0) return 0;
  const bool skip_corrupt = data[0] & 1;
  data::TarShardOptions options;
  options.input("jpg").target((data[0] & 2) ? "cls" : "txt").skip_corrupt(skip_corrupt);
  if (data[0] & 4) options.extra({"json"});
  try {
    data::TarShards shards({file.set(data + 1, size - 1)}, options);
    shards.start(0, 0, 1);
    for (int i = 0; i < 100000 && shards.next(); ++i) {
    }
    shards.start(1, 1, 2);
    (void)shards.skip(2);
    for (int i = 0; i < 100000 && shards.next(); ++i) {
    }
  } catch (const Error&) {
  } catch (const data::SkipSample&) {
    if (!skip_corrupt) throw;
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::tar)
