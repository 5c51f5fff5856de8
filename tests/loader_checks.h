// Shared by the data tests: one epoch of a loader as a list of batches, and batch-for-batch
// equality of two such lists.
#pragma once

#include <fulgur/data.h>

#include <doctest/doctest.h>

#include <vector>

namespace fulgur::test {

inline std::vector<fulgur::Batch> epoch(fulgur::BatchLoader& loader, int64_t e, int64_t skip = 0) {
  loader.start_epoch(e, skip);
  std::vector<fulgur::Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

inline void require_same(const std::vector<fulgur::Batch>& a, const std::vector<fulgur::Batch>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].input.equal(b[i].input));
    CHECK(a[i].target.equal(b[i].target));
  }
}

}  // namespace fulgur::test
