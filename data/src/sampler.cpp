#include <fulgur/data/sampler.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace fulgur::data {

Sampler::~Sampler() = default;

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(ErrorKind::invalid_argument, message);
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return {p, p + c.numel()};
}

at::Generator epoch_generator(uint64_t seed, int64_t epoch) {
  return at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
}

class Sequential final : public Sampler {
 public:
  explicit Sequential(int64_t n) : n_(n) {}
  std::vector<int64_t> indices(int64_t) const override {
    std::vector<int64_t> v(static_cast<size_t>(n_));
    std::iota(v.begin(), v.end(), int64_t{0});
    return v;
  }
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
};

class Random final : public Sampler {
 public:
  Random(int64_t n, uint64_t seed) : n_(n), seed_(seed) {}
  std::vector<int64_t> indices(int64_t epoch) const override {
    return to_vector(at::randperm(n_, epoch_generator(seed_, epoch), at::TensorOptions().dtype(at::kLong)));
  }
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
  uint64_t seed_;
};

class Weighted final : public Sampler {
 public:
  Weighted(at::Tensor weights, int64_t num_samples, bool replacement, uint64_t seed)
      : weights_(std::move(weights)), n_(num_samples), replacement_(replacement), seed_(seed) {}
  std::vector<int64_t> indices(int64_t epoch) const override {
    return to_vector(at::multinomial(weights_, n_, replacement_, epoch_generator(seed_, epoch)));
  }
  int64_t size() const override { return n_; }

 private:
  at::Tensor weights_;
  int64_t n_;
  bool replacement_;
  uint64_t seed_;
};

class Distributed final : public Sampler {
 public:
  Distributed(SamplerPtr inner, int64_t rank, int64_t replicas, bool drop_last)
      : inner_(std::move(inner)), rank_(rank), replicas_(replicas), drop_last_(drop_last) {}
  int64_t size() const override {
    const int64_t n = inner_->size();
    return drop_last_ ? n / replicas_ : (n + replicas_ - 1) / replicas_;
  }
  std::vector<int64_t> indices(int64_t epoch) const override {
    std::vector<int64_t> all = inner_->indices(epoch);
    const int64_t per = size();
    const int64_t total = per * replicas_;
    // Pad by repeating from the start (wrapping as often as needed for tiny datasets).
    const size_t n = all.size();
    for (size_t i = 0; static_cast<int64_t>(all.size()) < total; ++i) all.push_back(all[i % n]);
    std::vector<int64_t> mine;
    mine.reserve(static_cast<size_t>(per));
    for (int64_t i = rank_; i < total; i += replicas_) mine.push_back(all[static_cast<size_t>(i)]);
    return mine;
  }

 private:
  SamplerPtr inner_;
  int64_t rank_, replicas_;
  bool drop_last_;
};

}  // namespace

SamplerPtr sequential_sampler(int64_t n) {
  require(n >= 0, fmt::format("sequential_sampler: size {} is negative", n));
  return std::make_shared<Sequential>(n);
}

SamplerPtr random_sampler(int64_t n, uint64_t seed) {
  require(n >= 0, fmt::format("random_sampler: size {} is negative", n));
  return std::make_shared<Random>(n, seed);
}

SamplerPtr weighted_random_sampler(at::Tensor weights, int64_t num_samples, bool replacement, uint64_t seed) {
  require(weights.defined() && weights.dim() == 1 && weights.numel() > 0,
          "weighted_random_sampler: weights must be a non-empty 1-D tensor");
  weights = weights.to(at::kDouble).contiguous();
  require(
      (weights >= 0).all().item<bool>() && weights.isfinite().all().item<bool>() && weights.sum().item<double>() > 0,
      "weighted_random_sampler: weights must be finite, non-negative and not all zero");
  require(num_samples > 0, fmt::format("weighted_random_sampler: num_samples = {} must be positive", num_samples));
  require(replacement || num_samples <= (weights > 0).sum().item<int64_t>(),
          fmt::format("weighted_random_sampler: {} samples without replacement but only {} non-zero weights",
                      num_samples, (weights > 0).sum().item<int64_t>()));
  return std::make_shared<Weighted>(std::move(weights), num_samples, replacement, seed);
}

SamplerPtr distributed_sampler(SamplerPtr inner, int64_t rank, int64_t num_replicas, bool drop_last) {
  require(inner != nullptr, "distributed_sampler: no inner sampler");
  require(num_replicas >= 1 && rank >= 0 && rank < num_replicas,
          fmt::format("distributed_sampler: rank {} of {} replicas", rank, num_replicas));
  require(drop_last || inner->size() > 0 || num_replicas == 1, "distributed_sampler: cannot pad an empty sampler");
  if (num_replicas == 1 && !drop_last) return inner;
  return std::make_shared<Distributed>(std::move(inner), rank, num_replicas, drop_last);
}

BatchSampler::BatchSampler(SamplerPtr sampler, int64_t batch_size, bool drop_last)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last) {
  require(sampler_ != nullptr, "BatchSampler: no sampler");
  require(batch_size_ > 0, fmt::format("batch_size must be positive, got {}", batch_size_));
}

int64_t BatchSampler::num_batches() const {
  const int64_t n = sampler_->size();
  return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

std::vector<int64_t> BatchSampler::batch(const std::vector<int64_t>& epoch_indices, int64_t b) const {
  const int64_t begin = std::min<int64_t>(b * batch_size_, static_cast<int64_t>(epoch_indices.size()));
  const int64_t end = std::min<int64_t>(begin + batch_size_, static_cast<int64_t>(epoch_indices.size()));
  return {epoch_indices.begin() + begin, epoch_indices.begin() + end};
}

std::vector<std::vector<int64_t>> BatchSampler::batches(int64_t epoch) const {
  const std::vector<int64_t> all = sampler_->indices(epoch);
  std::vector<std::vector<int64_t>> out;
  for (int64_t b = 0; b < num_batches(); ++b) out.push_back(batch(all, b));
  return out;
}

}  // namespace fulgur::data
