#include "fashion_mnist.h"
#include "fashion_mnist_nets.h"

#include <fulgur/error.h>
#include <fulgur/optim/lion.h>
#include <fulgur/optim/muon.h>
#include <fulgur/sample_position.h>
#include <fulgur/suggest.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <system_error>

namespace fulgur::examples {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPackageHint = kFashionMnistPackageHint;

[[noreturn]] void io_error(const fs::path& file, const std::string& what) {
  throw Error(ErrorKind::io, fmt::format("{}: {}", file.string(), what));
}

// The file to read for an IDX name: the gzipped form if present, else the extracted one.
fs::path find_idx_file(const fs::path& dir, const std::string& name) {
  std::error_code ec;
  const fs::path gz = dir / (name + ".gz");
  if (fs::exists(gz, ec)) return gz;
  const fs::path plain = dir / name;
  if (fs::exists(plain, ec)) return plain;
  if (!fs::is_directory(dir, ec))
    throw Error(ErrorKind::io, fmt::format("Fashion-MNIST directory {} does not exist (looking for {}); {}",
                                           dir.string(), gz.filename().string(), kPackageHint));
  throw Error(ErrorKind::io, fmt::format("Fashion-MNIST file {} not found (nor the uncompressed {}); {}", gz.string(),
                                         plain.filename().string(), kPackageHint));
}

// A split as stored: uint8 pixels [N, 28, 28] (a quarter of the float bytes), int64 labels.
FashionMnistSplit read_split(const fs::path& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const fs::path images_file = find_idx_file(dir, prefix + "-images-idx3-ubyte");
  const fs::path labels_file = find_idx_file(dir, prefix + "-labels-idx1-ubyte");
  at::Tensor images = read_idx(images_file, 3);
  at::Tensor labels = read_idx(labels_file, 1);
  if (images.size(1) != 28 || images.size(2) != 28)
    io_error(images_file,
             fmt::format("images are {}x{}, Fashion-MNIST images are 28x28", images.size(1), images.size(2)));
  if (images.size(0) != labels.size(0))
    io_error(labels_file, fmt::format("holds {} labels but {} holds {} images", labels.size(0),
                                      images_file.filename().string(), images.size(0)));
  if (const int64_t max_label = labels.max().item<int64_t>(); max_label >= kFashionMnistClasses)
    io_error(labels_file,
             fmt::format("label {} out of range: Fashion-MNIST has {} classes", max_label, kFashionMnistClasses));
  return {images, labels.to(torch::kInt64)};
}

// The rows `sorted_rows` of `t` (ascending indices), moved down in place to the first rows, which it
// returns. The training part of the hold-out split is 92% of the file: a copy (index_select) would
// fault in 43 MB more at every start; row j's source is at or after j, so moving forward never
// overwrites a row still to move.
at::Tensor rows_moved_to_front(const at::Tensor& t, const at::Tensor& sorted_rows) {
  TORCH_CHECK(t.is_contiguous() && sorted_rows.scalar_type() == torch::kInt64);
  const int64_t count = sorted_rows.numel();
  const size_t row_bytes = static_cast<size_t>(t.numel() / std::max<int64_t>(t.size(0), 1)) * t.element_size();
  auto* base = static_cast<char*>(t.data_ptr());
  const int64_t* rows = sorted_rows.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < count; ++j)
    if (rows[j] != j) std::memmove(base + j * row_bytes, base + rows[j] * row_bytes, row_bytes);
  return t.narrow(0, 0, count);
}

// uint8 pixels [N, 28, 28] -> float32 [N, 1, 28, 28], (x / 255 - mean) / std computed as
// x * (1 / (255 std)) - mean / std in one kernel (a 0-dim float tensor plus uint8 pixels is float):
// four passes (convert, divide, subtract, divide) were four parallel regions per batch, each waking
// the intra-op threads with a futex call.
at::Tensor normalized_images(const at::Tensor& pixels) {
  static const at::Tensor shift = at::scalar_tensor(-kFashionMnistMean / kFashionMnistStd, at::kFloat);
  return at::add(shift, pixels, 1.0 / (255.0 * kFashionMnistStd)).unsqueeze(1);
}

FashionMnistSplit normalized(const FashionMnistSplit& raw) { return {normalized_images(raw.images), raw.labels}; }

// Serves another loader's uint8 batches normalized. The data module keeps its splits in uint8 and
// converts 64 images per batch instead of 60000 up front: 188 MB less memory for the training set,
// and the page faults of filling it (issue #16). Its position in samples is the inner loader's, so
// a run resumed mid-epoch with another number of processes deals out the rest of the epoch.
class NormalizingLoader final : public BatchLoader, public SamplePositionLoader {
 public:
  explicit NormalizingLoader(std::unique_ptr<BatchLoader> inner)
      : inner_(std::move(inner)), position_(sample_position_of(*inner_)) {}
  int64_t num_batches() const override { return inner_->num_batches(); }
  void start_epoch(int64_t epoch, int64_t skip_batches) override { inner_->start_epoch(epoch, skip_batches); }
  std::optional<Batch> next() override {
    std::optional<Batch> batch = inner_->next();
    if (batch) batch->input = normalized_images(batch->input);
    return batch;
  }
  void set_replica(int64_t rank, int64_t num_replicas) override { inner_->set_replica(rank, num_replicas); }
  int64_t epoch_samples() const override { return position_ ? position_->epoch_samples() : -1; }
  int64_t samples_consumed(int64_t batches) const override {
    return position_ ? position_->samples_consumed(batches) : -1;
  }
  int64_t start_epoch_at_sample(int64_t epoch, int64_t consumed) override {
    return position_->start_epoch_at_sample(epoch, consumed);
  }

 private:
  std::unique_ptr<BatchLoader> inner_;
  SamplePositionLoader* position_;  // the inner loader's, or nullptr
};

}  // namespace

FashionMnistSplit load_fashion_mnist(const fs::path& dir, bool train) { return normalized(read_split(dir, train)); }

// ---------------------------------------------------------------------------------------------
// DataModule

FashionMnistDataModule::FashionMnistDataModule(Options hp) {
  // Lightning's save_hyperparameters records defaults too: checkpoints and loggers see the values
  // actually used.
  hparams = with_defaults(hp, hparams_schema, "[data]");
  const std::string& owner = hparams.owner();
  dir_ = hparams.get_string("dir");
  batch_size_ = hparams.get_int("batch_size");
  num_workers_ = hparams.get_int("num_workers");
  val_count_ = hparams.get_int("val_split");
  const int64_t seed = hparams.get_int("seed");
  if (batch_size_ <= 0)
    throw Error(ErrorKind::config, fmt::format("{}: batch_size = {} must be positive", owner, batch_size_));
  if (num_workers_ < 0)
    throw Error(ErrorKind::config, fmt::format("{}: num_workers = {} must be >= 0", owner, num_workers_));
  if (val_count_ < 0)
    throw Error(ErrorKind::config,
                fmt::format("{}: val_split = {} must be >= 0 (images held out for validation)", owner, val_count_));
  if (seed < 0) throw Error(ErrorKind::config, fmt::format("{}: seed = {} must be >= 0", owner, seed));
  seed_ = static_cast<uint64_t>(seed);
}

void FashionMnistDataModule::set_batch_size(int64_t n) {
  if (n <= 0) throw Error(ErrorKind::config, fmt::format("[data] batch_size = {} must be positive", n));
  batch_size_ = n;
  hparams.set("batch_size", n);  // checkpoints record the size trained with, as Lightning's hparams do
}

void FashionMnistDataModule::setup(Stage stage) {
  if (stage == Stage::fit || stage == Stage::validate || stage == Stage::sanity_check) {
    if (train_.images.defined()) return;
    const FashionMnistSplit all = read_split(dir_, /*train=*/true);
    const int64_t n = all.images.size(0);
    if (val_count_ >= n)
      throw Error(ErrorKind::config,
                  fmt::format("{}: val_split = {} leaves no training images: the training split has {} images",
                              hparams.owner(), val_count_, n));
    // The held-out images depend only on the seed, so every run (and a resumed one) validates on
    // the same images. Sorting keeps each part in file order.
    at::Tensor perm = torch::randperm(n, at::detail::createCPUGenerator(seed_), torch::kInt64);
    at::Tensor val_idx = std::get<0>(perm.narrow(0, 0, val_count_).sort());
    at::Tensor train_idx = std::get<0>(perm.narrow(0, val_count_, n - val_count_).sort());
    if (val_count_ > 0) val_ = {all.images.index_select(0, val_idx), all.labels.index_select(0, val_idx)};
    train_ = {rows_moved_to_front(all.images, train_idx), rows_moved_to_front(all.labels, train_idx)};
  } else if (stage == Stage::test || stage == Stage::predict) {
    if (!test_.images.defined()) test_ = read_split(dir_, /*train=*/false);
  }
}

std::unique_ptr<BatchLoader> FashionMnistDataModule::loader(const FashionMnistSplit& split, bool shuffle,
                                                            const char* stage) const {
  if (!split.images.defined())
    throw Error(ErrorKind::runtime, fmt::format("FashionMnistDataModule: {} loader requested before setup()", stage));
  return std::make_unique<NormalizingLoader>(make_tensor_loader(
      split.images, split.labels,
      TensorLoaderOptions().batch_size(batch_size_).shuffle(shuffle).seed(seed_).num_workers(num_workers_)));
}

std::unique_ptr<BatchLoader> FashionMnistDataModule::train_loader() {
  setup(Stage::fit);  // no-op once loaded; lets tests ask for loaders without a Trainer
  return loader(train_, /*shuffle=*/true, "train");
}

std::unique_ptr<BatchLoader> FashionMnistDataModule::val_loader() {
  if (val_count_ == 0) return nullptr;
  setup(Stage::fit);
  return loader(val_, /*shuffle=*/false, "val");
}

std::unique_ptr<BatchLoader> FashionMnistDataModule::test_loader() {
  setup(Stage::test);
  return loader(test_, /*shuffle=*/false, "test");
}

std::unique_ptr<BatchLoader> FashionMnistDataModule::predict_loader() {
  setup(Stage::predict);
  return loader(test_, /*shuffle=*/false, "predict");
}

// ---------------------------------------------------------------------------------------------
// Models

FashionMnistClassifier::FashionMnistClassifier(Options hp) {
  hparams = with_defaults(hp, hparams_schema, "[model]");  // defaults recorded, as for the data
  const std::string& owner = hparams.owner();
  const std::string& optimizer = hparams.get_string("optimizer");
  const std::vector<std::string> optimizers = {"adam", "sgd", "lbfgs", "lion", "muon"};
  if (std::find(optimizers.begin(), optimizers.end(), optimizer) == optimizers.end()) {
    std::string message = fmt::format("{}: unknown optimizer '{}'", owner, optimizer);
    if (std::string s = closest_match(optimizer, optimizers); !s.empty())
      message += fmt::format("; did you mean '{}'?", s);
    throw Error(ErrorKind::config, message + " Choose \"adam\", \"sgd\", \"lbfgs\", \"lion\" or \"muon\".");
  }
  if (hparams.get_int("max_iter") < 1)
    throw Error(ErrorKind::config, fmt::format("{}: max_iter = {} must be >= 1", owner, hparams.get_int("max_iter")));
  const double lr = hparams.get_float("lr");
  const double weight_decay = hparams.get_float("weight_decay");
  const double momentum = hparams.get_float("momentum");
  const double dropout = hparams.get_float("dropout");
  if (!(lr > 0)) throw Error(ErrorKind::config, fmt::format("{}: lr = {} must be positive", owner, lr));
  if (!(weight_decay >= 0))
    throw Error(ErrorKind::config, fmt::format("{}: weight_decay = {} must be >= 0", owner, weight_decay));
  if (!(momentum >= 0)) throw Error(ErrorKind::config, fmt::format("{}: momentum = {} must be >= 0", owner, momentum));
  if (!(dropout >= 0 && dropout < 1))
    throw Error(ErrorKind::config, fmt::format("{}: dropout = {} must be in [0, 1)", owner, dropout));
}

StepOutput FashionMnistClassifier::training_step(const Batch& batch, int64_t) {
  at::Tensor loss = torch::nn::functional::cross_entropy(forward(batch.input), batch.target);
  log("train/loss", loss, LogOptions().prog_bar(true));
  return {loss};
}

StepOutput FashionMnistClassifier::evaluate(const Batch& batch, const char* loss_name, const char* acc_name,
                                            bool prog_bar) {
  at::Tensor logits = forward(batch.input);
  at::Tensor loss = torch::nn::functional::cross_entropy(logits, batch.target);
  at::Tensor acc = logits.argmax(1).eq(batch.target).to(torch::kFloat32).mean();
  // Both are epoch means weighted by batch size (the default), so a short last batch counts right.
  // Averaged over ranks at epoch end in a ddp run (a no-op in one process).
  log(loss_name, loss, LogOptions().prog_bar(prog_bar).sync_dist(true));
  log(acc_name, acc, LogOptions().prog_bar(prog_bar).sync_dist(true));
  return {loss};
}

StepOutput FashionMnistClassifier::validation_step(const Batch& batch, int64_t) {
  return evaluate(batch, "val/loss", "val/acc", /*prog_bar=*/true);
}

StepOutput FashionMnistClassifier::test_step(const Batch& batch, int64_t) {
  return evaluate(batch, "test/loss", "test/acc", /*prog_bar=*/false);
}

at::Tensor FashionMnistClassifier::predict_step(const Batch& batch, int64_t) { return forward(batch.input); }

std::shared_ptr<torch::optim::Optimizer> FashionMnistClassifier::make_optimizer() {
  const double lr = hparams.get_float("lr");
  const double weight_decay = hparams.get_float("weight_decay");
  const std::string& optimizer = hparams.get_string("optimizer");
  if (optimizer == "sgd")
    return std::make_shared<torch::optim::SGD>(
        parameters(), torch::optim::SGDOptions(lr).momentum(hparams.get_float("momentum")).weight_decay(weight_decay));
  // LBFGS re-evaluates the loss inside its step: the Trainer passes it a closure (fulgur/closure_step.h).
  if (optimizer == "lbfgs")
    return std::make_shared<torch::optim::LBFGS>(
        parameters(),
        torch::optim::LBFGSOptions(lr).max_iter(hparams.get_int("max_iter")).line_search_fn("strong_wolfe"));
  if (optimizer == "lion")
    return std::make_shared<fulgur::optim::Lion>(parameters(),
                                                 fulgur::optim::LionOptions(lr).weight_decay(weight_decay));
  // Muon for the hidden matrices, AdamW (same lr and weight decay) for biases and the rest.
  if (optimizer == "muon")
    return std::make_shared<fulgur::optim::Muon>(fulgur::optim::muon_param_groups(
        *this, fulgur::optim::MuonOptions(lr).weight_decay(weight_decay).adjust_lr_fn("match_rms_adamw"),
        fulgur::optim::MuonOptions(lr).weight_decay(weight_decay)));
  return std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(lr).weight_decay(weight_decay));
}

std::vector<OptimizerConfig> FashionMnistClassifier::configure_optimizers() {
  return {OptimizerConfig(make_optimizer())};
}

std::shared_ptr<FashionMnistClassifier> make_fashion_mnist_model(const Options& hparams) {
  const Options checked = with_defaults(hparams, FashionMnistClassifier::hparams_schema, "[model]");
  const std::string& arch = checked.get_string("arch");
  if (arch == "cnn") return std::make_shared<FashionMnistCnn>(hparams);
  if (arch == "mlp") return std::make_shared<FashionMnistMlp>(hparams);
  std::string message = fmt::format("{}: unknown arch '{}'", checked.owner(), arch);
  if (std::string s = closest_match(arch, {"cnn", "mlp"}); !s.empty())
    message += fmt::format("; did you mean '{}'?", s);
  throw Error(ErrorKind::config, message + " Choose \"cnn\" or \"mlp\".");
}

}  // namespace fulgur::examples
