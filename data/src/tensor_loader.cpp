#include <fulgur/data/data_loader.h>
#include <fulgur/data/tensor_loader.h>
#include <fulgur/error.h>
#include <fulgur/sample_position.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "remaining_deal.h"

namespace fulgur {

namespace {

// Batches from in-memory tensors. The order of an epoch is a pure function of (seed, epoch), so a
// run resumed mid-epoch (skip_batches) sees exactly what the uninterrupted run saw; with another
// number of replicas, it deals out what is left of the epoch (start_epoch_at_sample).
class TensorLoader final : public BatchLoader, public SamplePositionLoader {
 public:
  TensorLoader(at::Tensor inputs, at::Tensor targets, TensorLoaderOptions options)
      : inputs_(std::move(inputs)), targets_(std::move(targets)), options_(std::move(options)) {
    check(inputs_, targets_, options_);
  }

  static void check(const at::Tensor& inputs, const at::Tensor& targets, const TensorLoaderOptions& options) {
    if (!inputs.defined() || inputs.dim() == 0)
      throw Error(ErrorKind::invalid_argument, "make_tensor_loader: inputs must have a sample dimension");
    if (targets.defined() && targets.size(0) != inputs.size(0))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("make_tensor_loader: {} inputs but {} targets", inputs.size(0), targets.size(0)));
    if (options.batch_size_ <= 0)
      throw Error(ErrorKind::invalid_argument, fmt::format("batch_size must be positive, got {}", options.batch_size_));
  }
  ~TensorLoader() override { stop_workers(); }

  int64_t num_batches() const override {
    const int64_t n = samples_per_replica();
    return options_.drop_last_ ? n / options_.batch_size_ : (n + options_.batch_size_ - 1) / options_.batch_size_;
  }

  void set_replica(int64_t rank, int64_t num_replicas) override {
    rank_ = rank;
    replicas_ = std::max<int64_t>(1, num_replicas);
  }

  void start_epoch(int64_t epoch, int64_t skip_batches) override {
    stop_workers();
    const int64_t total = inputs_.size(0);
    at::Tensor order = epoch_order(epoch);
    // Distributed sampling: pad by wrapping (or cut, with drop_last) so that every replica gets the
    // same count, then stride: replica r takes samples r, r + R, r + 2R, ...
    const int64_t per_replica = samples_per_replica();
    const int64_t padded = per_replica * replicas_;
    if (padded > total) order = at::cat({order, order.slice(0, 0, padded - total)});
    indices_ = order.slice(0, rank_, padded, replicas_).contiguous();
    // In-order single-replica epochs need no gather: batches are views, as in a hand-written loop.
    sequential_ = !options_.shuffle_ && replicas_ == 1;
    segment_start_ = 0;
    epoch_batches_ = num_batches();
    next_batch_ = std::min(skip_batches, epoch_batches_);
    if (options_.num_workers_ > 0) start_workers();
  }

  int64_t epoch_samples() const override { return inputs_.size(0); }

  int64_t samples_consumed(int64_t batches) const override {
    return std::min(segment_start_ + batches * options_.batch_size_ * replicas_, inputs_.size(0));
  }

  int64_t start_epoch_at_sample(int64_t epoch, int64_t consumed) override {
    stop_workers();
    const at::Tensor order = epoch_order(epoch).contiguous();
    const int64_t* p = order.data_ptr<int64_t>();
    segment_start_ = std::clamp<int64_t>(consumed, 0, order.numel());
    const std::vector<int64_t> mine =
        data::detail::deal_remaining({p, p + order.numel()}, segment_start_, rank_, replicas_, options_.drop_last_);
    indices_ = at::tensor(mine, at::kLong);
    sequential_ = false;
    const int64_t per = static_cast<int64_t>(mine.size()), bs = options_.batch_size_;
    epoch_batches_ = options_.drop_last_ ? per / bs : (per + bs - 1) / bs;
    next_batch_ = 0;
    if (options_.num_workers_ > 0) start_workers();
    return epoch_batches_;
  }

  std::optional<Batch> next() override {
    if (options_.num_workers_ <= 0) {
      if (next_batch_ >= epoch_batches_) return std::nullopt;
      return make_batch(next_batch_++);
    }
    std::unique_lock lock(mutex_);
    ready_cv_.wait(lock, [&] { return !queue_.empty() || produced_all_; });
    if (queue_.empty()) return std::nullopt;
    Batch b = std::move(queue_.front());
    queue_.pop_front();
    space_cv_.notify_one();
    return b;
  }

 private:
  // Batches assembled or waiting at most: as DataLoaderOptions::prefetch (0: two per worker).
  int64_t prefetch() const {
    return options_.prefetch_ > 0 ? options_.prefetch_ : 2 * std::max<int64_t>(1, options_.num_workers_);
  }

  // The epoch's global order: a permutation from (seed, epoch), or the rows in order.
  at::Tensor epoch_order(int64_t epoch) const {
    const int64_t total = inputs_.size(0);
    if (!options_.shuffle_) return at::arange(total, at::kLong);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed_ + static_cast<uint64_t>(epoch));
    return at::randperm(total, gen, at::TensorOptions().dtype(at::kLong));
  }

  // As torch's DistributedSampler: drop_last drops the tail that does not divide evenly, otherwise
  // the first samples are repeated to pad every replica to the same count.
  int64_t samples_per_replica() const {
    const int64_t total = inputs_.size(0);
    return options_.drop_last_ ? total / replicas_ : (total + replicas_ - 1) / replicas_;
  }

  Batch make_batch(int64_t index) const {
    const int64_t begin = index * options_.batch_size_;
    const int64_t end = std::min<int64_t>(begin + options_.batch_size_, indices_.size(0));
    Batch b;
    if (sequential_) {
      b.input = inputs_.slice(0, begin, end);
      if (targets_.defined()) b.target = targets_.slice(0, begin, end);
      return b;
    }
    at::Tensor idx = indices_.slice(0, begin, end);
    b.input = inputs_.index_select(0, idx);
    if (targets_.defined()) b.target = targets_.index_select(0, idx);
    return b;
  }

  // Worker threads assemble batches in order (each takes the next index) into a bounded queue.
  void start_workers() {
    const int64_t end = epoch_batches_;
    // Set before the first worker starts: from then on every shared field is the workers' and is
    // touched under mutex_ only (ThreadSanitizer caught this check after the spawn loop).
    produced_all_ = next_batch_ >= end;
    stopping_ = false;
    next_to_emit_ = next_batch_;
    for (int64_t w = 0; w < options_.num_workers_; ++w) {
      workers_.emplace_back([this, end] {
        // index_select runs parallel regions: one thread here, or each worker opens an OpenMP team
        // as large as the training step's on the same cores (issue #16).
        data::limit_intra_op_threads_for_this_thread(1);
        while (true) {
          int64_t index;
          {
            std::unique_lock lock(mutex_);
            space_cv_.wait(lock,
                           [&] { return stopping_ || static_cast<int64_t>(queue_.size() + in_flight_) < prefetch(); });
            if (stopping_ || next_batch_ >= end) break;
            index = next_batch_++;
            ++in_flight_;
          }
          Batch b = make_batch(index);
          std::unique_lock lock(mutex_);
          // Keep the epoch order: wait until it is this batch's turn.
          order_cv_.wait(lock, [&] { return stopping_ || next_to_emit_ == index; });
          if (stopping_) break;
          queue_.push_back(std::move(b));
          --in_flight_;
          ++next_to_emit_;
          if (next_to_emit_ >= end) produced_all_ = true;
          order_cv_.notify_all();
          ready_cv_.notify_one();
        }
        std::lock_guard lock(mutex_);
        if (next_to_emit_ >= end) produced_all_ = true;
        ready_cv_.notify_all();
      });
    }
  }

  void stop_workers() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    space_cv_.notify_all();
    order_cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    queue_.clear();
    in_flight_ = 0;
  }

  at::Tensor inputs_, targets_, indices_;
  TensorLoaderOptions options_;
  int64_t rank_ = 0, replicas_ = 1;
  int64_t next_batch_ = 0;
  int64_t epoch_batches_ = 0;  // batches of the current epoch (or of its remainder) for this replica
  int64_t segment_start_ = 0;  // samples of the epoch's global order dealt before this run's part
  bool sequential_ = false;

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable ready_cv_, space_cv_, order_cv_;
  std::deque<Batch> queue_;
  int64_t in_flight_ = 0, next_to_emit_ = 0;
  bool produced_all_ = false, stopping_ = false;
};

// The tensors as a map-style dataset, for the options that work per sample: row i of the inputs
// (and targets) is sample i.
class TensorRows final : public data::Dataset {
 public:
  TensorRows(at::Tensor inputs, at::Tensor targets) : inputs_(std::move(inputs)), targets_(std::move(targets)) {}
  int64_t size() const override { return inputs_.size(0); }
  data::Sample get(int64_t index) const override {
    data::Sample s;
    s.input = inputs_[index];
    if (targets_.defined()) s.target = targets_[index];
    return s;
  }

 private:
  at::Tensor inputs_, targets_;
};

}  // namespace

std::unique_ptr<BatchLoader> make_tensor_loader(at::Tensor inputs, at::Tensor targets, TensorLoaderOptions options) {
  const bool per_sample = options.sampler_ || options.transform_ || options.collate_ || options.pin_memory_;
  if (!per_sample) return std::make_unique<TensorLoader>(std::move(inputs), std::move(targets), std::move(options));
  // Same checks as the fast path, so both report a bad argument alike.
  TensorLoader::check(inputs, targets, options);
  return data::make_data_loader(std::make_shared<TensorRows>(std::move(inputs), std::move(targets)),
                                std::move(options));
}

}  // namespace fulgur
