// Subsets of a map-style dataset and torch.utils.data.random_split: a train / validation split of
// one table, reproducible from a seed.
#pragma once

#include <fulgur/data/dataset.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fulgur::data {

// The samples of `dataset` at `indices`, in that order (torch.utils.data.Subset).
class Subset final : public Dataset {
 public:
  // Throws fulgur::Error(invalid_argument) for an index outside [0, dataset->size()).
  Subset(std::shared_ptr<const Dataset> dataset, std::vector<int64_t> indices);
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Sample get(int64_t index) const override;

  const std::vector<int64_t>& indices() const { return indices_; }
  const std::shared_ptr<const Dataset>& dataset() const { return dataset_; }

 private:
  std::shared_ptr<const Dataset> dataset_;
  std::vector<int64_t> indices_;
};

// torch.utils.data.random_split(dataset, lengths, generator=torch.Generator().manual_seed(seed)):
// the same subsets, index for index. `lengths` are sample counts that add up to the dataset's size,
// or fractions that add up to 1 (each gets floor(size * fraction) samples, and the remainder goes
// one by one to the first subsets, as torch does).
std::vector<std::shared_ptr<Subset>> random_split(std::shared_ptr<const Dataset> dataset, std::vector<double> lengths,
                                                  uint64_t seed);

}  // namespace fulgur::data
