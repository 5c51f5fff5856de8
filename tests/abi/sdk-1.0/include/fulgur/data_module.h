// The engine's data interfaces: the DataModule (Lightning's LightningDataModule) and the
// BatchLoader it hands out for each stage. Concrete loaders and datasets live in the data library
// (fulgur/data.h, target Fulgur::data); a model plugin needs only this header.
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
