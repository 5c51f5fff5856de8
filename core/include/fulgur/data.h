// Data: the DataModule (Lightning's LightningDataModule) and the loaders it hands out.
#pragma once

#include <fulgur/options.h>
#include <fulgur/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace fulgur {

// A source of batches for one stage. Deterministic given (seed, epoch) so that a resumed run sees
// exactly the batches the uninterrupted run would have seen.
class BatchLoader {
 public:
  virtual ~BatchLoader();
  // Batches per epoch for this rank (-1 if unknown).
  virtual int64_t num_batches() const = 0;
  // Prepares iteration over `epoch`, skipping the first `skip_batches` (mid-epoch resume).
  virtual void start_epoch(int64_t epoch, int64_t skip_batches = 0) = 0;
  // The next batch, or nullopt at the end of the epoch.
  virtual std::optional<Batch> next() = 0;
  // Data-parallel sharding: this loader serves replica `rank` of `num_replicas`.
  virtual void set_replica(int64_t rank, int64_t num_replicas) = 0;
};

struct TensorLoaderOptions {
  TensorLoaderOptions& batch_size(int64_t v) {
    batch_size_ = v;
    return *this;
  }
  TensorLoaderOptions& shuffle(bool v) {
    shuffle_ = v;
    return *this;
  }
  TensorLoaderOptions& seed(uint64_t v) {
    seed_ = v;
    return *this;
  }
  TensorLoaderOptions& drop_last(bool v) {
    drop_last_ = v;
    return *this;
  }
  // Background threads assembling the next batches while the current one trains (0: inline).
  TensorLoaderOptions& num_workers(int64_t v) {
    num_workers_ = v;
    return *this;
  }
  TensorLoaderOptions& prefetch(int64_t v) {
    prefetch_ = v;
    return *this;
  }

  int64_t batch_size_ = 32;
  bool shuffle_ = false;
  uint64_t seed_ = 0;
  bool drop_last_ = false;
  int64_t num_workers_ = 0;
  int64_t prefetch_ = 2;
};

// Batches from in-memory tensors (first dimension = samples). Shuffling draws a permutation from
// (seed, epoch), and with several replicas each sees a disjoint, equally sized slice, like torch's
// DistributedSampler: padded by wrapping around, or with drop_last the uneven tail is dropped
// (and, as DataLoader's drop_last, the last incomplete batch of each replica).
std::unique_ptr<BatchLoader> make_tensor_loader(at::Tensor inputs, at::Tensor targets, TensorLoaderOptions options);

class DataModule {
 public:
  virtual ~DataModule();
  virtual void prepare_data() {}
  virtual void setup(Stage) {}
  virtual void teardown(Stage) {}
  virtual std::unique_ptr<BatchLoader> train_loader() = 0;
  virtual std::unique_ptr<BatchLoader> val_loader() { return nullptr; }
  virtual std::unique_ptr<BatchLoader> test_loader() { return nullptr; }
  // Several validation or test sets (Lightning's list of loaders): each batch's step gets the
  // loader's index (dataloader_idx) and, with more than one loader, values logged during its pass
  // get the suffix "/dataloader_idx_N". By default the single val_loader() / test_loader().
  virtual std::vector<std::unique_ptr<BatchLoader>> val_loaders();
  virtual std::vector<std::unique_ptr<BatchLoader>> test_loaders();
  virtual std::unique_ptr<BatchLoader> predict_loader() { return nullptr; }

  // The training batch size, for the batch-size finder (Lightning's `batch_size` attribute of a
  // LightningDataModule); -1: this DataModule does not offer one (the default).
  virtual int64_t batch_size() const { return -1; }
  // Sets it; the next train_loader() uses it. A DataModule that offers batch_size() overrides this
  // too. The default throws fulgur::Error(config): the finder then says what to implement.
  virtual void set_batch_size(int64_t n);

  // The extension interface named `id` that this DataModule implements, or nullptr (the default).
  // Capabilities added after SDK 1.0 arrive this way (fulgur/extension.h). Must not throw.
  virtual void* extension(std::string_view id) noexcept;

  // Hyperparameters from the TOML [data] table.
  Options hparams;
};

}  // namespace fulgur
