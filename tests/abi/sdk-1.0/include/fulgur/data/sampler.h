// Samplers: which dataset indices an epoch visits, in which order. Every sampler is a pure function
// of the epoch (and its seed), so a resumed run sees exactly the order the interrupted run saw and
// skipping k batches is arithmetic, not loading.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fulgur::data {

class Sampler {
 public:
  virtual ~Sampler();
  // The indices of `epoch`, in order.
  virtual std::vector<int64_t> indices(int64_t epoch) const = 0;
  // How many indices each epoch has.
  virtual int64_t size() const = 0;
};
using SamplerPtr = std::shared_ptr<const Sampler>;

// 0, 1, ..., n-1 every epoch.
SamplerPtr sequential_sampler(int64_t n);

// A permutation of [0, n) drawn from a CPU generator seeded with seed + epoch: the same order as
// Python's `torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))`, which is what
// torch's DistributedSampler(shuffle=True) uses.
SamplerPtr random_sampler(int64_t n, uint64_t seed);

// `num_samples` indices drawn with probability proportional to `weights` (torch.multinomial, with or
// without replacement) from a generator seeded with seed + epoch.
SamplerPtr weighted_random_sampler(at::Tensor weights, int64_t num_samples, bool replacement, uint64_t seed);

// Replica `rank` of `num_replicas` gets a disjoint, equally long part of `inner`'s epoch, as torch's
// DistributedSampler: the epoch is padded by repeating its first indices (or, with drop_last, its
// uneven tail is dropped) to a multiple of num_replicas, then replica r takes positions r, r+R, ...
SamplerPtr distributed_sampler(SamplerPtr inner, int64_t rank, int64_t num_replicas, bool drop_last);

// Groups a sampler's indices into batches of batch_size (the last one shorter unless drop_last).
class BatchSampler {
 public:
  BatchSampler(SamplerPtr sampler, int64_t batch_size, bool drop_last);
  int64_t num_batches() const;
  // Batch `b` of an epoch whose indices are `epoch_indices` (from sampler().indices(epoch)).
  std::vector<int64_t> batch(const std::vector<int64_t>& epoch_indices, int64_t b) const;
  std::vector<std::vector<int64_t>> batches(int64_t epoch) const;
  const SamplerPtr& sampler() const { return sampler_; }
  int64_t batch_size() const { return batch_size_; }

 private:
  SamplerPtr sampler_;
  int64_t batch_size_;
  bool drop_last_;
};

}  // namespace fulgur::data
