// DataLoader: batches from a Dataset (or an IterableDataset) through sampler, transforms and
// collate, assembled by worker threads into a bounded prefetch queue. Implements fulgur::BatchLoader,
// so a DataModule returns it from train_loader() and the Trainer's loops drive it.
#pragma once

#include <fulgur/data_module.h>
#include <fulgur/data/collate.h>
#include <fulgur/data/dataset.h>
#include <fulgur/data/sampler.h>
#include <fulgur/data/transforms.h>

#include <cstdint>
#include <memory>

namespace fulgur::data {

struct DataLoaderOptions {
  DataLoaderOptions& batch_size(int64_t v) {
    batch_size_ = v;
    return *this;
  }
  // Map-style only: a permutation per epoch from (seed, epoch); ignored when a sampler is given.
  DataLoaderOptions& shuffle(bool v) {
    shuffle_ = v;
    return *this;
  }
  // Seeds the shuffle and every sample's transform RNG (with the epoch and the sample's index).
  DataLoaderOptions& seed(uint64_t v) {
    seed_ = v;
    return *this;
  }
  // Drops the last incomplete batch (and, with several replicas, the uneven tail of the dataset).
  DataLoaderOptions& drop_last(bool v) {
    drop_last_ = v;
    return *this;
  }
  // Worker threads assembling batches (0: in next(), on the caller's thread).
  DataLoaderOptions& num_workers(int64_t v) {
    num_workers_ = v;
    return *this;
  }
  // Batches being assembled or waiting, at most (0: 2 per worker). Bounds memory: workers wait.
  DataLoaderOptions& prefetch(int64_t v) {
    prefetch_ = v;
    return *this;
  }
  // Map-style: the order of indices (overrides shuffle). Sharded across replicas by the loader.
  DataLoaderOptions& sampler(SamplerPtr v) {
    sampler_ = std::move(v);
    return *this;
  }
  DataLoaderOptions& transform(TransformPtr v) {
    transform_ = std::move(v);
    return *this;
  }
  DataLoaderOptions& collate(CollateFn v) {
    collate_ = std::move(v);
    return *this;
  }
  // Copies each batch into page-locked memory when a CUDA device is present (faster, asynchronous
  // host-to-device copies); without CUDA it does nothing.
  DataLoaderOptions& pin_memory(bool v) {
    pin_memory_ = v;
    return *this;
  }

  int64_t batch_size_ = 32;
  bool shuffle_ = false;
  uint64_t seed_ = 0;
  bool drop_last_ = false;
  int64_t num_workers_ = 0;
  int64_t prefetch_ = 0;
  SamplerPtr sampler_;
  TransformPtr transform_;
  CollateFn collate_;
  bool pin_memory_ = false;
};

// Guarantees:
// - Batch b of epoch e holds the same samples, transformed the same way, for any num_workers: a
//   batch is a function of (seed, epoch, b), and batches are handed out in order.
// - start_epoch(e, k) gives batches k, k+1, ... of epoch e; map-style datasets skip by sampler
//   position (nothing is loaded), iterable ones through IterableDataset::skip.
// - A sample that throws ends the epoch: next() rethrows it as fulgur::Error naming the sample
//   index (and keeping the reader's message: file, line), after the batches before it.
// - Destroying the loader (or starting a new epoch) mid-epoch stops and joins the workers.
// - Worker threads run ATen with one intra-op thread, so they do not take the cores of the
//   training step's own thread pool.
class DataLoader final : public BatchLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options);
  DataLoader(std::shared_ptr<IterableDataset> dataset, DataLoaderOptions options);
  ~DataLoader() override;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  int64_t num_batches() const override;
  void start_epoch(int64_t epoch, int64_t skip_batches = 0) override;
  std::optional<Batch> next() override;
  void set_replica(int64_t rank, int64_t num_replicas) override;

  // Samples left out so far because a reader or transform skipped them (SkipSample), all epochs.
  int64_t skipped_samples() const;
  const DataLoaderOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<DataLoader> make_data_loader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options);
std::unique_ptr<DataLoader> make_data_loader(std::shared_ptr<IterableDataset> dataset, DataLoaderOptions options);

// Call at the start of a thread that runs ATen work next to the training step (a loader worker):
// that thread's parallel regions then use one thread. at::set_num_threads would change every
// thread's count; this changes only the caller's (OpenMP's per-thread setting). Returns the count
// the thread had.
int limit_intra_op_threads_for_this_thread(int threads = 1);

}  // namespace fulgur::data
