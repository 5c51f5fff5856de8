// ABI corpus, datamodule `corpus_line_data`: a fulgur::DataModule built against the frozen SDK 1.0
// headers, linking the engine only: its hand-written BatchLoader serves points of y = 3x - 1 in a
// fixed order, sharded by stride across replicas.
#include <fulgur/data_module.h>
#include <fulgur/plugin.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/linspace.h>

#include <algorithm>
#include <memory>
#include <optional>

namespace {

class LineLoader final : public fulgur::BatchLoader {
 public:
  LineLoader(int64_t samples, int64_t batch_size) : batch_size_(batch_size) {
    x_ = at::linspace(-1, 1, samples).unsqueeze(1);
    y_ = 3 * x_ - 1;
  }
  int64_t num_batches() const override { return (rows() + batch_size_ - 1) / batch_size_; }
  void start_epoch(int64_t, int64_t skip_batches) override { next_ = std::min(skip_batches, num_batches()); }
  std::optional<fulgur::Batch> next() override {
    if (next_ >= num_batches()) return std::nullopt;
    const int64_t begin = rank_ + next_++ * batch_size_ * replicas_;
    const int64_t end = std::min(begin + batch_size_ * replicas_, x_.size(0));
    fulgur::Batch batch;
    batch.input = x_.slice(0, begin, end, replicas_);
    batch.target = y_.slice(0, begin, end, replicas_);
    return batch;
  }
  void set_replica(int64_t rank, int64_t num_replicas) override {
    rank_ = rank;
    replicas_ = std::max<int64_t>(1, num_replicas);
  }

 private:
  int64_t rows() const { return (x_.size(0) - rank_ + replicas_ - 1) / replicas_; }
  at::Tensor x_, y_;
  int64_t batch_size_, rank_ = 0, replicas_ = 1, next_ = 0;
};

class CorpusLineData final : public fulgur::DataModule {
 public:
  static constexpr auto hparams_schema =
      fulgur::option_schema(FULGUR_OPTION(integer, samples, "Points on the line", 64),
                            FULGUR_OPTION(integer, batch_size, "Points per batch", 16));

  explicit CorpusLineData(const fulgur::Options& hp)
      : samples_(hp.get_int("samples")), batch_(hp.get_int("batch_size")) {
    if (samples_ < 1 || batch_ < 1)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "datamodule 'corpus_line_data': samples and batch_size must be >= 1");
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override { return loader(); }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override { return loader(); }
  int64_t batch_size() const override { return batch_; }
  void set_batch_size(int64_t n) override { batch_ = n; }

 private:
  std::unique_ptr<fulgur::BatchLoader> loader() const { return std::make_unique<LineLoader>(samples_, batch_); }
  int64_t samples_, batch_;
};

}  // namespace

FULGUR_PLUGIN(CorpusLineData, "corpus_line_data", "1.0.0", "ABI corpus: points on the line y = 3x - 1")
