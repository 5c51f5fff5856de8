#include <fulgur/data/subset.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <numeric>

namespace fulgur::data {

Subset::Subset(std::shared_ptr<const Dataset> dataset, std::vector<int64_t> indices)
    : dataset_(std::move(dataset)), indices_(std::move(indices)) {
  if (!dataset_) throw Error(ErrorKind::invalid_argument, "Subset: no dataset");
  const int64_t n = dataset_->size();
  for (int64_t i : indices_)
    if (i < 0 || i >= n)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("Subset: index {} is outside the dataset's {} samples", i, n));
}

Sample Subset::get(int64_t index) const {
  if (index < 0 || index >= size())
    throw Error(ErrorKind::invalid_argument, fmt::format("Subset: sample {} out of range ({} samples)", index, size()));
  return dataset_->get(indices_[static_cast<size_t>(index)]);
}

std::vector<std::shared_ptr<Subset>> random_split(std::shared_ptr<const Dataset> dataset, std::vector<double> lengths,
                                                  uint64_t seed) {
  if (!dataset) throw Error(ErrorKind::invalid_argument, "random_split: no dataset");
  if (lengths.empty()) throw Error(ErrorKind::invalid_argument, "random_split: no lengths");
  const int64_t n = dataset->size();
  const double total = std::accumulate(lengths.begin(), lengths.end(), 0.0);
  std::vector<int64_t> counts;
  // torch's test, to the letter: math.isclose(sum, 1) (relative tolerance 1e-9) and sum <= 1.
  if (std::abs(total - 1.0) <= 1e-9 * std::max(1.0, std::abs(total)) && total <= 1.0) {
    for (size_t i = 0; i < lengths.size(); ++i) {
      if (lengths[i] < 0 || lengths[i] > 1)
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("random_split: fraction {} at index {} is not between 0 and 1", lengths[i], i));
      counts.push_back(static_cast<int64_t>(std::floor(static_cast<double>(n) * lengths[i])));
    }
    const int64_t remainder = n - std::accumulate(counts.begin(), counts.end(), int64_t{0});
    for (int64_t i = 0; i < remainder; ++i) ++counts[static_cast<size_t>(i) % counts.size()];
  } else {
    for (size_t i = 0; i < lengths.size(); ++i) {
      if (lengths[i] < 0 || lengths[i] != std::floor(lengths[i]))
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("random_split: length {} at index {} is neither a sample count nor a fraction of a "
                                "set that adds up to 1",
                                lengths[i], i));
      counts.push_back(static_cast<int64_t>(lengths[i]));
    }
  }
  const int64_t sum = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (sum != n)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("random_split: the lengths add up to {} samples, the dataset has {}", sum, n));
  // randperm on a CPU generator seeded like torch.Generator().manual_seed(seed): torch's order.
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor perm = at::randperm(n, generator, at::TensorOptions().dtype(at::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  std::vector<std::shared_ptr<Subset>> out;
  int64_t offset = 0;
  for (int64_t count : counts) {
    out.push_back(std::make_shared<Subset>(dataset, std::vector<int64_t>(p + offset, p + offset + count)));
    offset += count;
  }
  return out;
}

}  // namespace fulgur::data
