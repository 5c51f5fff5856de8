#include <fulgur/data.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace fulgur {

BatchLoader::~BatchLoader() = default;
DataModule::~DataModule() = default;
void* DataModule::extension(std::string_view) noexcept { return nullptr; }

void DataModule::set_batch_size(int64_t n) {
  throw Error(ErrorKind::config,
              fmt::format("the DataModule cannot change its batch size (asked for {}): override "
                          "DataModule::batch_size() and set_batch_size(n) so that train_loader() uses n",
                          n));
}

std::vector<std::unique_ptr<BatchLoader>> DataModule::val_loaders() {
  std::vector<std::unique_ptr<BatchLoader>> loaders;
  if (auto loader = val_loader()) loaders.push_back(std::move(loader));
  return loaders;
}

std::vector<std::unique_ptr<BatchLoader>> DataModule::test_loaders() {
  std::vector<std::unique_ptr<BatchLoader>> loaders;
  if (auto loader = test_loader()) loaders.push_back(std::move(loader));
  return loaders;
}

namespace {

// Batches from in-memory tensors. The order of an epoch is a pure function of (seed, epoch), so a
// run resumed mid-epoch (skip_batches) sees exactly what the uninterrupted run saw.
class TensorLoader final : public BatchLoader {
 public:
  TensorLoader(at::Tensor inputs, at::Tensor targets, TensorLoaderOptions options)
      : inputs_(std::move(inputs)), targets_(std::move(targets)), options_(options) {
    if (!inputs_.defined() || inputs_.dim() == 0)
      throw Error(ErrorKind::invalid_argument, "make_tensor_loader: inputs must have a sample dimension");
    if (targets_.defined() && targets_.size(0) != inputs_.size(0))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("make_tensor_loader: {} inputs but {} targets", inputs_.size(0), targets_.size(0)));
    if (options_.batch_size_ <= 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("batch_size must be positive, got {}", options_.batch_size_));
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
    at::Tensor order;
    if (options_.shuffle_) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed_ + static_cast<uint64_t>(epoch));
      order = at::randperm(total, gen, at::TensorOptions().dtype(at::kLong));
    } else {
      order = at::arange(total, at::kLong);
    }
    // Distributed sampling: pad by wrapping (or cut, with drop_last) so that every replica gets the
    // same count, then stride: replica r takes samples r, r + R, r + 2R, ...
    const int64_t per_replica = samples_per_replica();
    const int64_t padded = per_replica * replicas_;
    if (padded > total) order = at::cat({order, order.slice(0, 0, padded - total)});
    indices_ = order.slice(0, rank_, padded, replicas_).contiguous();
    // In-order single-replica epochs need no gather: batches are views, as in a hand-written loop.
    sequential_ = !options_.shuffle_ && replicas_ == 1;
    next_batch_ = std::min(skip_batches, num_batches());
    if (options_.num_workers_ > 0) start_workers();
  }

  std::optional<Batch> next() override {
    if (options_.num_workers_ <= 0) {
      if (next_batch_ >= num_batches()) return std::nullopt;
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
    const int64_t end = num_batches();
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
            space_cv_.wait(lock, [&] {
              return stopping_ || static_cast<int64_t>(queue_.size() + in_flight_) < options_.prefetch_;
            });
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
  bool sequential_ = false;

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable ready_cv_, space_cv_, order_cv_;
  std::deque<Batch> queue_;
  int64_t in_flight_ = 0, next_to_emit_ = 0;
  bool produced_all_ = false, stopping_ = false;
};

}  // namespace

std::unique_ptr<BatchLoader> make_tensor_loader(at::Tensor inputs, at::Tensor targets, TensorLoaderOptions options) {
  return std::make_unique<TensorLoader>(std::move(inputs), std::move(targets), options);
}

}  // namespace fulgur
