#include <fulgur/data/dataset.h>

namespace fulgur::data {

Dataset::~Dataset() = default;
IterableDataset::~IterableDataset() = default;

int64_t IterableDataset::skip(int64_t count) {
  int64_t n = 0;
  while (n < count && next()) ++n;
  return n;
}

}  // namespace fulgur::data
