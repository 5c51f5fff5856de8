// fulgur/data: samplers, collate, transforms and the DataLoader's guarantees (worker-count
// invariance, skip-resume, errors, shutdown, one intra-op thread per worker).
#include <fulgur/data/collate.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/sampler.h>
#include <fulgur/data/transforms.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include "loader_checks.h"
#include "test_support.h"

namespace {

namespace d = fulgur::data;
namespace fs = std::filesystem;
using fulgur::test::contains;
using fulgur::test::error_from;

// Images of varying size whose pixels depend on the index; optionally throws at one index, or
// sleeps, and counts calls.
class SyntheticImages final : public d::Dataset {
 public:
  explicit SyntheticImages(int64_t n, int64_t fail_at = -1) : n_(n), fail_at_(fail_at) {}
  int64_t size() const override { return n_; }
  d::Sample get(int64_t i) const override {
    ++calls;
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (i == fail_at_) throw std::runtime_error("bad pixels");
    const int64_t h = 40, w = 48;
    d::Sample s;
    s.input = ((at::arange(3 * h * w, at::kLong) * (i + 3)) % 251).to(at::kByte).view({3, h, w});
    s.target = at::scalar_tensor(i, at::kLong);
    return s;
  }
  mutable std::atomic<int64_t> calls{0};
  std::chrono::milliseconds delay{0};

 private:
  int64_t n_, fail_at_;
};

d::TransformPtr augment() {
  return d::compose({d::random_resized_crop(d::RandomResizedCropOptions(24)), d::random_horizontal_flip(),
                     d::normalize({0.5, 0.4, 0.3}, {0.2, 0.25, 0.3})});
}

using fulgur::test::epoch;
using fulgur::test::require_same;

std::vector<int64_t> flat(const std::vector<fulgur::Batch>& batches) {
  std::vector<int64_t> out;
  for (const auto& b : batches)
    for (int64_t i = 0; i < b.target.size(0); ++i) out.push_back(b.target[i].item<int64_t>());
  return out;
}

}  // namespace

TEST_CASE("data: samplers cover the dataset, and distributed ones give ranks disjoint, equal parts") {
  CHECK(d::sequential_sampler(5)->indices(3) == std::vector<int64_t>{0, 1, 2, 3, 4});
  auto random = d::random_sampler(10, 7);
  // torch's DistributedSampler order: randperm with a generator seeded with seed + epoch.
  at::Tensor expected = at::randperm(10, at::make_generator<at::CPUGeneratorImpl>(7 + 2), at::kLong);
  CHECK(at::tensor(random->indices(2), at::kLong).equal(expected));
  CHECK(random->indices(2) == random->indices(2));
  CHECK(random->indices(2) != random->indices(3));

  for (bool drop_last : {false, true}) {
    for (int64_t n : {10, 11, 12, 2}) {
      CAPTURE(drop_last);
      CAPTURE(n);
      const int64_t replicas = 3;
      std::multiset<int64_t> seen;
      size_t per = 0;
      for (int64_t r = 0; r < replicas; ++r) {
        auto s = d::distributed_sampler(d::random_sampler(n, 1), r, replicas, drop_last);
        auto idx = s->indices(4);
        CHECK(static_cast<int64_t>(idx.size()) == s->size());
        if (r == 0) per = idx.size();
        CHECK(idx.size() == per);  // equal counts: no rank waits for another at a collective
        seen.insert(idx.begin(), idx.end());
      }
      const std::set<int64_t> distinct(seen.begin(), seen.end());
      if (drop_last) {
        CHECK(distinct.size() == seen.size());  // disjoint
        CHECK(static_cast<int64_t>(seen.size()) == n / replicas * replicas);
      } else {
        CHECK(static_cast<int64_t>(distinct.size()) == n);  // everything, padded by repeats
        CHECK(static_cast<int64_t>(seen.size()) == (n + replicas - 1) / replicas * replicas);
      }
    }
  }
  CHECK(error_from([] { d::distributed_sampler(d::sequential_sampler(4), 3, 3, false); }).kind() ==
        fulgur::ErrorKind::invalid_argument);
}

TEST_CASE("data: the weighted sampler follows the weights and never draws a zero weight") {
  at::Tensor w = at::tensor({1.0, 0.0, 3.0, 0.0}, at::kDouble);
  auto s = d::weighted_random_sampler(w, 4000, true, 3);
  auto idx = s->indices(0);
  CHECK(idx == s->indices(0));
  int64_t zeros = 0, twos = 0;
  for (int64_t i : idx) {
    zeros += (i == 1 || i == 3);
    twos += (i == 2);
  }
  CHECK(zeros == 0);
  CHECK(twos > 2800);
  CHECK(twos < 3200);
  auto without = d::weighted_random_sampler(w, 2, false, 3)->indices(5);
  CHECK(std::set<int64_t>(without.begin(), without.end()) == std::set<int64_t>{0, 2});
  CHECK(contains(error_from([&] { d::weighted_random_sampler(w, 3, false, 0); }).what(), "non-zero weights"));
  CHECK(
      contains(error_from([] { d::weighted_random_sampler(at::tensor({-1.0}), 1, true, 0); }).what(), "non-negative"));
}

TEST_CASE("data: the batch sampler groups indices, keeping or dropping the short last batch") {
  d::BatchSampler keep(d::sequential_sampler(7), 3, false), drop(d::sequential_sampler(7), 3, true);
  CHECK(keep.num_batches() == 3);
  CHECK(drop.num_batches() == 2);
  CHECK(keep.batches(0).back() == std::vector<int64_t>{6});
  CHECK(drop.batches(0).back() == std::vector<int64_t>{3, 4, 5});
}

TEST_CASE("data: collate stacks samples, or pads variable-length ones with a mask") {
  std::vector<d::Sample> samples(3);
  for (int64_t i = 0; i < 3; ++i) {
    samples[i].input = at::full({i + 1, 2}, static_cast<double>(i + 1));
    samples[i].target = at::arange(i + 1, at::kLong);
  }
  fulgur::Batch b = d::collate_pad(samples, d::PadCollateOptions().padding_value(-1));
  CHECK(b.input.sizes() == at::IntArrayRef{3, 3, 2});
  CHECK(b.input[0][1][0].item<double>() == -1);
  CHECK(b.input[2][2][1].item<double>() == 3);
  CHECK(b.extra[0].equal(at::tensor({1, 0, 0, 1, 1, 0, 1, 1, 1}, at::kLong).to(at::kBool).view({3, 3})));
  CHECK(b.extra[1].equal(at::tensor({1, 2, 3}, at::kLong)));
  CHECK(b.target[0][2].item<int64_t>() == -100);
  CHECK(contains(error_from([&] { d::collate_stack(samples); }).what(), "pad_collate"));

  std::vector<d::Sample> same(2);
  for (auto& s : same) {
    s.input = at::ones({2, 2});
    s.target = at::scalar_tensor(1, at::kLong);
    s.extra = {at::zeros({3})};
  }
  fulgur::Batch st = d::collate_stack(same);
  CHECK(st.input.sizes() == at::IntArrayRef{2, 2, 2});
  CHECK(st.target.sizes() == at::IntArrayRef{2});
  CHECK(st.extra.at(0).sizes() == at::IntArrayRef{2, 3});
}

TEST_CASE("data: transforms are torchvision's, and a sample's randomness comes from (seed, epoch, index)") {
  d::Sample s;
  s.input = at::arange(2 * 4 * 6, at::kLong).to(at::kByte).view({2, 4, 6});
  d::SampleRng rng(1, 0, 0);
  // normalize: uint8 scaled to [0, 1] first, as ToTensor + Normalize.
  d::Sample n = d::normalize({0.5, 0.25}, {0.5, 0.5})->apply(s, rng);
  CHECK((n.input.scalar_type() == at::kFloat));
  CHECK(n.input.allclose((s.input.to(at::kFloat) / 255 - at::tensor({0.5f, 0.25f}).view({2, 1, 1})) / 0.5));
  d::Sample flipped = d::random_horizontal_flip(1.0)->apply(s, rng);
  CHECK(flipped.input.equal(s.input.flip(-1)));
  CHECK(d::random_horizontal_flip(0.0)->apply(s, rng).input.equal(s.input));
  d::Sample crop = d::random_crop(d::RandomCropOptions(3, 2).padding(1))->apply(s, rng);
  CHECK(crop.input.sizes() == at::IntArrayRef{2, 3, 2});
  d::Sample rrc = d::random_resized_crop(d::RandomResizedCropOptions(5, 7))->apply(s, rng);
  CHECK(rrc.input.sizes() == at::IntArrayRef{2, 5, 7});
  CHECK((rrc.input.scalar_type() == at::kByte));
  d::Sample centre = d::compose({d::resize(8), d::center_crop(8, 8)})->apply(s, rng);
  CHECK(centre.input.sizes() == at::IntArrayRef{2, 8, 8});

  // Same (seed, epoch, index): same draws; any of them different: different draws.
  auto t = augment();
  auto image = [] {
    d::Sample x;
    x.input = ((at::arange(3 * 50 * 60, at::kLong) * 7) % 256).to(at::kByte).view({3, 50, 60});
    return x;
  };
  d::SampleRng a(5, 1, 9), b(5, 1, 9), c(5, 2, 9), e(5, 1, 10);
  at::Tensor ta = t->apply(image(), a).input, tb = t->apply(image(), b).input;
  CHECK(ta.equal(tb));
  CHECK(!ta.equal(t->apply(image(), c).input));
  CHECK(!ta.equal(t->apply(image(), e).input));
  CHECK(contains(error_from([] { d::normalize({0.5}, {0.0}); }).what(), "positive"));
}

TEST_CASE("data: batch content does not depend on the number of workers, random transforms included") {
  auto data = std::make_shared<SyntheticImages>(37);
  std::vector<fulgur::Batch> reference;
  for (int64_t workers : {0, 1, 2, 4}) {
    CAPTURE(workers);
    d::DataLoader loader(
        data, d::DataLoaderOptions().batch_size(5).shuffle(true).seed(11).num_workers(workers).transform(augment()));
    CHECK(loader.num_batches() == 8);
    auto batches = epoch(loader, 2);
    CHECK(batches.size() == 8);
    CHECK(batches.back().size() == 2);
    if (workers == 0) {
      reference = std::move(batches);
      std::vector<int64_t> all = flat(reference);
      CHECK(std::set<int64_t>(all.begin(), all.end()).size() == 37);
    } else {
      require_same(batches, reference);
    }
  }
  // Another epoch: another order and other crops.
  d::DataLoader loader(data,
                       d::DataLoaderOptions().batch_size(5).shuffle(true).seed(11).num_workers(2).transform(augment()));
  auto other = epoch(loader, 3);
  CHECK(!other[0].input.equal(reference[0].input));
}

TEST_CASE("data: start_epoch(e, k) gives batches k.. of the full epoch, without loading the skipped ones") {
  auto data = std::make_shared<SyntheticImages>(29);
  for (int64_t workers : {0, 2}) {
    CAPTURE(workers);
    d::DataLoader loader(
        data, d::DataLoaderOptions().batch_size(4).shuffle(true).seed(3).num_workers(workers).transform(augment()));
    auto full = epoch(loader, 1);
    data->calls = 0;
    auto resumed = epoch(loader, 1, 5);
    CHECK(data->calls.load() == 29 - 5 * 4);  // the skipped 20 samples were never read
    require_same(resumed, std::vector<fulgur::Batch>(full.begin() + 5, full.end()));
    CHECK(epoch(loader, 1, 100).empty());
  }
  // Replicas: each rank's part of the epoch, also resumable.
  d::DataLoader rank1(data, d::DataLoaderOptions().batch_size(4).shuffle(true).seed(3).num_workers(2));
  rank1.set_replica(1, 2);
  CHECK(rank1.num_batches() == 4);  // 15 samples
  auto full = epoch(rank1, 0);
  require_same(epoch(rank1, 0, 2), std::vector<fulgur::Batch>(full.begin() + 2, full.end()));
}

TEST_CASE("data: a failing sample surfaces in next() with its index, after the batches before it") {
  for (int64_t workers : {0, 3}) {
    CAPTURE(workers);
    auto data = std::make_shared<SyntheticImages>(40, 13);
    d::DataLoader loader(data, d::DataLoaderOptions().batch_size(4).num_workers(workers));
    loader.start_epoch(0);
    for (int i = 0; i < 3; ++i) CHECK(loader.next().has_value());  // samples 0..11
    const fulgur::Error e = error_from([&] { loader.next(); });
    CHECK(contains(e.what(), "sample 13"));
    CHECK(contains(e.what(), "bad pixels"));
    CHECK(!loader.next().has_value());  // the epoch ended there
    // The next epoch starts cleanly (and fails at the same place).
    loader.start_epoch(1);
    CHECK(loader.next().has_value());
  }
}

TEST_CASE("data: workers stop on destruction mid-epoch, and back-pressure bounds what they load ahead") {
  auto data = std::make_shared<SyntheticImages>(1000);
  data->delay = std::chrono::milliseconds(2);
  {
    d::DataLoader loader(data, d::DataLoaderOptions().batch_size(4).num_workers(2).prefetch(3));
    loader.start_epoch(0);
    CHECK(loader.next().has_value());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    // One batch taken, at most 3 more claimed ahead (each of 4 samples).
    CHECK(data->calls.load() <= 4 * 4);
  }  // destroyed with workers blocked on the full queue: must join, not hang or crash
  const int64_t after = data->calls.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(data->calls.load() == after);
  // Restarting an epoch mid-way stops the previous epoch's workers too.
  d::DataLoader loader(data, d::DataLoaderOptions().batch_size(4).num_workers(2));
  loader.start_epoch(0);
  loader.next();
  loader.start_epoch(1, 3);
  CHECK(loader.next()->target[0].item<int64_t>() == 12);
}

TEST_CASE("data: loader workers run ATen with one intra-op thread, leaving the caller's count alone") {
  const int main_threads = at::get_num_threads();
  auto seen = std::make_shared<std::atomic<int>>(0);
  auto record = d::lambda([seen](d::Sample s, d::SampleRng&) {
    seen->store(std::max(seen->load(), at::get_num_threads()));
    return s;
  });
  d::DataLoader loader(std::make_shared<SyntheticImages>(16),
                       d::DataLoaderOptions().batch_size(4).num_workers(2).transform(record));
  epoch(loader, 0);
  CHECK(seen->load() == 1);
  CHECK(at::get_num_threads() == main_threads);
  // The existing tensor loader's workers too (index_select runs parallel regions): while they work,
  // the process has the caller's threads plus one per worker, not an OpenMP team per worker (which
  // the tensor loader had before: 2 extra threads here on a 2-core machine).
  (void)at::randn({1 << 20}).sum();  // the caller's own OpenMP team exists before counting
  auto threads = [] {
    int n = 0;
    for (const auto& e : fs::directory_iterator("/proc/self/task")) n += e.is_directory() ? 1 : 0;
    return n;
  };
  const int before = threads();
  auto tl = fulgur::make_tensor_loader(
      at::randn({4096, 3, 32, 32}), at::arange(4096),
      fulgur::TensorLoaderOptions().batch_size(256).shuffle(true).num_workers(2).prefetch(8));
  int peak = 0;
  for (int e = 0; e < 2; ++e) {
    tl->start_epoch(e);
    while (tl->next()) peak = std::max(peak, threads());
  }
  CHECK(peak <= before + 2);
  CHECK(at::get_num_threads() == main_threads);
}

TEST_CASE("data: variable-length sequences through the loader: padded batches with a mask, any worker count") {
  // Sequence i has length 1 + i % 5 and holds i; an iterable stream of them, and a map-style view.
  struct Sequences final : d::Dataset {
    int64_t size() const override { return 23; }
    d::Sample get(int64_t i) const override {
      d::Sample s;
      s.input = at::full({1 + i % 5}, static_cast<double>(i), at::kFloat);
      s.target = at::full({1 + i % 5}, i, at::kLong);
      return s;
    }
  };
  auto data = std::make_shared<Sequences>();
  std::vector<fulgur::Batch> reference;
  for (int64_t workers : {0, 2}) {
    d::DataLoader loader(data, d::DataLoaderOptions().batch_size(4).shuffle(true).seed(5).num_workers(workers).collate(
                                   d::pad_collate()));
    auto batches = epoch(loader, 0);
    REQUIRE(batches.size() == 6);
    for (const auto& b : batches) {
      const at::Tensor mask = b.extra.at(0), lengths = b.extra.at(1);
      CHECK(mask.sum(1).equal(lengths));
      CHECK(b.input.size(1) == lengths.max().item<int64_t>());
      CHECK(b.target.masked_select(mask.logical_not()).eq(-100).all().item<bool>());
    }
    if (workers == 0)
      reference = batches;
    else
      require_same(batches, reference);
  }
}
