// Datasets: where samples come from. Map-style (size + get) for data that can be addressed by
// index, iterable for streams read in order (tar shards, sockets, generators).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

namespace fulgur::data {

// One example: the per-sample counterpart of fulgur::Batch (collate stacks samples into a Batch).
struct Sample {
  at::Tensor input;
  at::Tensor target;
  std::vector<at::Tensor> extra;
};

// Thrown by Dataset::get / IterableDataset::next of a reader asked to skip corrupt samples
// (skip_corrupt): the DataLoader leaves that sample out of its batch and counts it. Readers that
// are not asked to skip throw fulgur::Error naming the file and the sample index instead.
struct SkipSample : std::exception {
  const char* what() const noexcept override { return "sample skipped"; }
};

// Map-style: samples addressed by an index in [0, size()). get() is called concurrently from the
// DataLoader's worker threads, so it must be safe to call from several threads at once (const and
// no shared mutable state, or its own locking).
class Dataset {
 public:
  virtual ~Dataset();
  virtual int64_t size() const = 0;
  virtual Sample get(int64_t index) const = 0;
};

// Streaming: samples read in order. The DataLoader calls start() and next() from one thread at a
// time (under its lock), in the order the samples make up batches, so the stream's order is the
// epoch's order whatever the number of workers; expensive per-sample work (decoding) belongs in a
// Transform, which runs in parallel.
class IterableDataset {
 public:
  virtual ~IterableDataset();
  // Rewinds to the beginning of `epoch` for replica `rank` of `num_replicas`.
  virtual void start(int64_t epoch, int64_t rank, int64_t num_replicas) = 0;
  // The next sample, or nullopt at the end of the stream.
  virtual std::optional<Sample> next() = 0;
  // Moves past `count` samples (mid-epoch resume). Readers override this to skip without decoding.
  virtual int64_t skip(int64_t count);
  // Samples per epoch for this replica, or -1 if not known without reading the stream.
  virtual int64_t size_hint() const { return -1; }
};

}  // namespace fulgur::data
