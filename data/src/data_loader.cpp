#include <fulgur/data/data_loader.h>
#include <fulgur/data/tar_shards.h>
#include <fulgur/error.h>
#include <fulgur/sample_position.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "remaining_deal.h"

namespace fulgur::data {

namespace {

// pin_memory pins for the process's accelerator (cuda, or a PrivateUse1 plugin device, ...) when
// one is usable; without one there is nothing to pin for (as torch.utils.data.DataLoader).
bool can_pin_memory() {
  const std::optional<c10::DeviceType> accelerator = at::getAccelerator(/*checked=*/false);
  return accelerator && at::globalContext().getAcceleratorHooksInterface(accelerator).isAvailable();
}

constexpr int64_t kUnknown = std::numeric_limits<int64_t>::max();

// A batch or the error that prevented it.
struct Result {
  std::optional<Batch> batch;
  std::exception_ptr error;
};

// Prefixes an exception with the sample it came from, keeping the reader's message (file, line).
[[noreturn]] void rethrow_for_sample(int64_t sample, int64_t batch, int64_t epoch) {
  const std::string where = fmt::format("DataLoader: sample {} (batch {} of epoch {})", sample, batch, epoch);
  try {
    throw;
  } catch (const Error& e) {
    throw Error(e.kind(), fmt::format("{}: {}", where, e.what()));
  } catch (const std::exception& e) {
    throw Error(ErrorKind::runtime, fmt::format("{}: {}", where, e.what()));
  } catch (...) {
    throw Error(ErrorKind::runtime, fmt::format("{}: unknown exception", where));
  }
}
}  // namespace

// The loader's position in global samples (fulgur/sample_position.h) lives here: DataLoader's
// own layout is fixed by its public header, so the DataLoader registers its Impl for it.
struct DataLoader::Impl final : SamplePositionLoader {
  std::shared_ptr<const Dataset> map;
  std::shared_ptr<IterableDataset> stream;
  DataLoaderOptions options;
  int64_t rank = 0, replicas = 1;
  SamplerPtr base;                      // map-style: the epoch's global order
  std::optional<BatchSampler> batches;  // map-style, for the current replica
  int64_t segment_start = 0;            // samples of the epoch's global order dealt before this run's part
  std::atomic<int64_t> skipped{0};
  int64_t skipped_before_epoch = 0;  // to report this epoch's count once, at its end
  bool epoch_reported = false;

  // Epoch state. Batches [next_batch, end) are still to be claimed; next_emit is the next one
  // next() hands out. Under `mutex` when workers run.
  int64_t epoch = 0;
  std::vector<int64_t> epoch_indices;
  int64_t next_batch = 0, next_emit = 0, end = 0;
  bool stream_done = false;

  std::vector<std::thread> workers;
  std::mutex mutex;
  std::condition_variable ready_cv, space_cv;
  std::map<int64_t, Result> results;
  bool stopping = false;

  void build_sampler() {
    if (!map) return;
    base = options.sampler_   ? options.sampler_
           : options.shuffle_ ? random_sampler(map->size(), options.seed_)
                              : sequential_sampler(map->size());
    batches.emplace(distributed_sampler(base, rank, replicas, drops_tail()), options.batch_size_, options.drop_last_);
  }

  int64_t prefetch() const {
    return options.prefetch_ > 0 ? options.prefetch_ : 2 * std::max<int64_t>(1, options.num_workers_);
  }

  // The index that seeds a sample's RNG: its position in the epoch across all replicas, so that it
  // depends on neither the worker count nor which thread handles it (nor, after a resume with
  // another number of replicas, on how many there are).
  int64_t global_position(int64_t position) const { return segment_start + position * replicas + rank; }

  bool drops_tail() const { return options.drop_last_ && replicas > 1; }

  int64_t epoch_samples() const override { return map ? base->size() : -1; }

  // A stream whose replicas take its samples round robin (replica r of R: positions r, r + R, ...,
  // as TarShards deals them) has one global order too, the stream itself, though of unknown
  // length: what every replica handed out is its prefix, whichever shard it reached. Other streams
  // split themselves in ways the loader cannot know.
  bool round_robin_stream() const { return stream && dynamic_cast<const TarShards*>(stream.get()) != nullptr; }

  int64_t samples_consumed(int64_t handed_out) const override {
    const int64_t consumed = segment_start + handed_out * options.batch_size_ * replicas;
    if (map) return std::min(consumed, base->size());
    return round_robin_stream() ? consumed : -1;
  }

  int64_t start_epoch_at_sample(int64_t e, int64_t consumed) override {
    if (!map && !round_robin_stream())
      throw Error(ErrorKind::checkpoint,
                  "DataLoader: this iterable dataset splits itself among the ranks in its own way, so its position "
                  "is kept per rank, not in global samples, and it cannot resume mid-epoch with another number of "
                  "processes: resume with the number of processes that wrote the checkpoint, or from a checkpoint "
                  "saved at an epoch end (TarShards, which deals its stream round robin, can)");
    stop_workers();
    skipped_before_epoch = skipped.load();
    epoch_reported = false;
    epoch = e;
    stream_done = false;
    next_batch = next_emit = 0;
    if (map) {
      segment_start = std::clamp<int64_t>(consumed, 0, base->size());
      epoch_indices = detail::deal_remaining(base->indices(e), segment_start, rank, replicas, drops_tail());
      const int64_t per = static_cast<int64_t>(epoch_indices.size()), bs = options.batch_size_;
      end = options.drop_last_ ? per / bs : (per + bs - 1) / bs;
    } else {
      // Positions consumed, consumed + 1, ... are dealt round robin again: this replica's are those
      // congruent to consumed + rank modulo the replicas, so the stream is started as that replica
      // and moves past the ones before `consumed` without decoding them (reading their headers).
      segment_start = std::max<int64_t>(0, consumed);
      const int64_t as_rank = (segment_start + rank) % replicas;
      const int64_t before = segment_start > as_rank ? (segment_start - as_rank + replicas - 1) / replicas : 0;
      stream->start(e, as_rank, replicas);
      if (stream->skip(before) < before) stream_done = true;
      end = stream_done ? 0 : kUnknown;
    }
    for (int64_t w = 0; w < options.num_workers_; ++w) workers.emplace_back([this] { worker_loop(); });
    return map ? end : -1;
  }

  // Streaming: reads the samples of the next batch (under the lock when workers run). Returns false
  // at the end of the stream (or, with drop_last, before a short last batch).
  bool pull(std::vector<Sample>& out, int64_t batch, std::exception_ptr& error) {
    out.clear();
    const int64_t first = batch * options.batch_size_;
    while (static_cast<int64_t>(out.size()) < options.batch_size_ && !stream_done) {
      try {
        std::optional<Sample> s = stream->next();
        if (!s) {
          stream_done = true;
          break;
        }
        out.push_back(std::move(*s));
      } catch (const SkipSample&) {
        ++skipped;
      } catch (...) {
        try {
          rethrow_for_sample(global_position(first + static_cast<int64_t>(out.size())), batch, epoch);
        } catch (...) {
          error = std::current_exception();
        }
        stream_done = true;
        return true;
      }
    }
    if (out.empty()) return false;
    if (options.drop_last_ && static_cast<int64_t>(out.size()) < options.batch_size_) return false;
    return true;
  }

  // Loads (map-style), transforms and collates batch `b`; runs on a worker or in next().
  Result produce(int64_t b, std::vector<Sample> samples) {
    Result r;
    try {
      std::vector<Sample> kept;
      if (map) {
        const std::vector<int64_t> idx = batches->batch(epoch_indices, b);
        kept.reserve(idx.size());
        for (size_t j = 0; j < idx.size(); ++j) {
          const int64_t position = b * options.batch_size_ + static_cast<int64_t>(j);
          try {
            Sample s = map->get(idx[j]);
            if (options.transform_) {
              SampleRng rng(options.seed_, epoch, global_position(position));
              s = options.transform_->apply(std::move(s), rng);
            }
            kept.push_back(std::move(s));
          } catch (const SkipSample&) {
            ++skipped;
          } catch (...) {
            rethrow_for_sample(idx[j], b, epoch);
          }
        }
      } else {
        kept.reserve(samples.size());
        for (size_t j = 0; j < samples.size(); ++j) {
          const int64_t position = global_position(b * options.batch_size_ + static_cast<int64_t>(j));
          try {
            Sample s = std::move(samples[j]);
            if (options.transform_) {
              SampleRng rng(options.seed_, epoch, position);
              s = options.transform_->apply(std::move(s), rng);
            }
            kept.push_back(std::move(s));
          } catch (const SkipSample&) {
            ++skipped;
          } catch (...) {
            rethrow_for_sample(position, b, epoch);
          }
        }
      }
      if (kept.empty()) return r;  // every sample skipped: no batch
      Batch batch = options.collate_ ? options.collate_(kept) : collate_stack(kept);
      if (options.pin_memory_ && can_pin_memory()) {
        if (batch.input.defined()) batch.input = batch.input.pin_memory();
        if (batch.target.defined()) batch.target = batch.target.pin_memory();
        for (auto& t : batch.extra)
          if (t.defined()) t = t.pin_memory();
      }
      r.batch = std::move(batch);
    } catch (...) {
      r.error = std::current_exception();
    }
    return r;
  }

  void worker_loop() {
    limit_intra_op_threads_for_this_thread(1);
    std::vector<Sample> samples;
    while (true) {
      int64_t b;
      std::exception_ptr pull_error;
      {
        std::unique_lock lock(mutex);
        // Back-pressure: claim a batch only while fewer than prefetch() are claimed but not taken.
        space_cv.wait(lock, [&] { return stopping || next_batch - next_emit < prefetch(); });
        if (stopping || next_batch >= end) break;
        b = next_batch;
        if (stream) {
          // Reading the stream under the lock keeps its order the epoch's order; decoding and the
          // other transforms run outside it, in parallel.
          if (!pull(samples, b, pull_error)) {
            end = b;
            ready_cv.notify_all();
            break;
          }
          if (pull_error) end = b + 1;
        }
        ++next_batch;
      }
      Result r = pull_error ? Result{std::nullopt, pull_error} : produce(b, std::move(samples));
      samples.clear();
      std::lock_guard lock(mutex);
      results.emplace(b, std::move(r));
      ready_cv.notify_all();
    }
    std::lock_guard lock(mutex);
    ready_cv.notify_all();
  }

  void stop_workers() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    space_cv.notify_all();
    ready_cv.notify_all();
    for (auto& t : workers) t.join();
    workers.clear();
    results.clear();
    stopping = false;
  }

  void start_epoch(int64_t e, int64_t skip) {
    stop_workers();
    epoch = e;
    stream_done = false;
    segment_start = 0;
    skip = std::max<int64_t>(0, skip);
    if (map) {
      epoch_indices = batches->sampler()->indices(e);
      end = batches->num_batches();
      next_batch = std::min(skip, end);
    } else {
      stream->start(e, rank, replicas);
      end = kUnknown;
      // Skipping a stream still reads it, but the reader moves past members without decoding.
      const int64_t want = skip * options.batch_size_;
      const int64_t got = stream->skip(want);
      next_batch = skip;
      if (got < want) {
        stream_done = true;
        end = std::min(end, got / options.batch_size_);  // nothing left to hand out
        next_batch = std::min(next_batch, end);
      }
    }
    next_emit = next_batch;
    for (int64_t w = 0; w < options.num_workers_; ++w) workers.emplace_back([this] { worker_loop(); });
  }

  std::optional<Batch> next_inline() {
    while (next_emit < end) {
      const int64_t b = next_emit;
      std::vector<Sample> samples;
      std::exception_ptr error;
      if (stream && !pull(samples, b, error)) {
        end = b;
        break;
      }
      ++next_emit;
      ++next_batch;
      if (error) {
        end = next_emit;
        std::rethrow_exception(error);
      }
      Result r = produce(b, std::move(samples));
      if (r.error) {
        end = next_emit;
        std::rethrow_exception(r.error);
      }
      if (r.batch) return std::move(r.batch);
    }
    return std::nullopt;
  }

  std::optional<Batch> next() {
    if (options.num_workers_ <= 0) return next_inline();
    while (true) {
      Result r;
      {
        std::unique_lock lock(mutex);
        ready_cv.wait(lock, [&] { return next_emit >= end || results.count(next_emit) > 0; });
        auto it = results.find(next_emit);
        if (it == results.end()) return std::nullopt;  // end of epoch
        r = std::move(it->second);
        results.erase(it);
        ++next_emit;
      }
      space_cv.notify_all();
      if (r.error) {
        // The batches before this one were handed out; nothing after it will be.
        stop_workers();
        end = next_emit;
        next_batch = next_emit;
        std::rethrow_exception(r.error);
      }
      if (r.batch) return std::move(r.batch);
    }
  }
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!dataset) throw Error(ErrorKind::invalid_argument, "DataLoader: no dataset");
  if (options.batch_size_ <= 0)
    throw Error(ErrorKind::invalid_argument, fmt::format("batch_size must be positive, got {}", options.batch_size_));
  if (options.num_workers_ < 0)
    throw Error(ErrorKind::invalid_argument, fmt::format("num_workers = {} must be >= 0", options.num_workers_));
  if (options.sampler_ && options.shuffle_)
    throw Error(ErrorKind::invalid_argument, "DataLoader: shuffle and a sampler are mutually exclusive (as in torch)");
  impl_->map = std::move(dataset);
  impl_->options = std::move(options);
  impl_->build_sampler();
  register_sample_position(*this, impl_.get());
}

DataLoader::DataLoader(std::shared_ptr<IterableDataset> dataset, DataLoaderOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!dataset) throw Error(ErrorKind::invalid_argument, "DataLoader: no dataset");
  if (options.batch_size_ <= 0)
    throw Error(ErrorKind::invalid_argument, fmt::format("batch_size must be positive, got {}", options.batch_size_));
  if (options.num_workers_ < 0)
    throw Error(ErrorKind::invalid_argument, fmt::format("num_workers = {} must be >= 0", options.num_workers_));
  if (options.sampler_ || options.shuffle_)
    throw Error(ErrorKind::invalid_argument,
                "DataLoader: an iterable dataset has its own order (no sampler, no shuffle)");
  impl_->stream = std::move(dataset);
  impl_->options = std::move(options);
  register_sample_position(*this, impl_.get());  // answers that a stream has no such position
}

DataLoader::~DataLoader() {
  unregister_sample_position(*this);
  impl_->stop_workers();
}

int64_t DataLoader::num_batches() const {
  if (impl_->map) return impl_->batches->num_batches();
  const int64_t n = impl_->stream->size_hint();
  if (n < 0) return -1;
  const int64_t bs = impl_->options.batch_size_;
  return impl_->options.drop_last_ ? n / bs : (n + bs - 1) / bs;
}

void DataLoader::start_epoch(int64_t epoch, int64_t skip_batches) {
  impl_->stop_workers();  // before taking the baseline: the new epoch's workers count from it
  impl_->skipped_before_epoch = impl_->skipped.load();
  impl_->epoch_reported = false;
  impl_->start_epoch(epoch, skip_batches);
}

std::optional<Batch> DataLoader::next() {
  std::optional<Batch> batch = impl_->next();
  if (!batch && !impl_->epoch_reported) {
    // skip_corrupt leaves samples out silently in the batches; the run's log says how many.
    impl_->epoch_reported = true;
    const int64_t total = impl_->skipped.load();
    if (const int64_t now = total - impl_->skipped_before_epoch; now > 0)
      spdlog::warn("DataLoader: epoch {} left out {} corrupt sample(s) (skip_corrupt; {} in all so far)", impl_->epoch,
                   now, total);
  }
  return batch;
}

void DataLoader::set_replica(int64_t rank, int64_t num_replicas) {
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas)
    throw Error(ErrorKind::invalid_argument, fmt::format("DataLoader: rank {} of {} replicas", rank, num_replicas));
  impl_->stop_workers();
  impl_->rank = rank;
  impl_->replicas = num_replicas;
  impl_->build_sampler();
}

int64_t DataLoader::skipped_samples() const { return impl_->skipped.load(); }

const DataLoaderOptions& DataLoader::options() const { return impl_->options; }

std::unique_ptr<DataLoader> make_data_loader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options) {
  return std::make_unique<DataLoader>(std::move(dataset), std::move(options));
}

std::unique_ptr<DataLoader> make_data_loader(std::shared_ptr<IterableDataset> dataset, DataLoaderOptions options) {
  return std::make_unique<DataLoader>(std::move(dataset), std::move(options));
}

}  // namespace fulgur::data
