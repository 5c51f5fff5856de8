// Fashion-MNIST for Fulgur: an IDX reader, a DataModule and two classifiers (a small CNN and an
// MLP). The example program, the tests and the step-time benchmark all use this library, so the
// header stays cheap to include (no <torch/torch.h>; the layers live in fashion_mnist.cpp).
#pragma once

#include <fulgur/data.h>
#include <fulgur/module.h>
#include <fulgur/option_spec.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace fulgur::examples {

// Where the Debian package dataset-fashion-mnist installs the gzipped IDX files.
inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";
// What to do when the files are missing.
inline constexpr const char* kFashionMnistPackageHint =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist), or set [data] dir "
    "to a directory holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and "
    "t10k-labels-idx1-ubyte.gz";
inline constexpr int64_t kFashionMnistClasses = 10;
// Mean and standard deviation of the training pixels (scaled to [0, 1]).
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;

// Reads one IDX file, gzipped (`name.gz`, preferred) or plain (`name`, as torchvision leaves it
// after extracting). Checks the magic number (unsigned bytes, `expected_dims` dimensions) and that
// the payload is exactly the size the header announces. Returns a uint8 tensor of the header's
// shape. Throws fulgur::Error(io) naming the file.
at::Tensor read_idx(const std::filesystem::path& file, int64_t expected_dims);

struct FashionMnistSplit {
  at::Tensor images;  // float32 [N, 1, 28, 28], normalized: (x / 255 - mean) / std
  at::Tensor labels;  // int64 [N], values in [0, 10)
};

// Loads the training (60000 images) or test (10000 images) split from `dir`.
FashionMnistSplit load_fashion_mnist(const std::filesystem::path& dir, bool train);

// [data] hyperparameters:
//   dir         directory with the IDX files (default kFashionMnistDefaultDir)
//   batch_size  64
//   num_workers 0     background threads assembling batches
//   val_split   5000  training images held out for validation (0: no validation loader)
//   seed        42    fixes which images are held out and the shuffling order
// Unknown keys are rejected with a suggestion, like the Trainer's own tables; the defaults come
// from hparams_schema whether the options come from `fulgur fit` or from code.
class FashionMnistDataModule : public DataModule {
 public:
  // The schema of [data] for `fulgur fit` (the fashion_mnist plugin) and fulgur::cli_main.
  static constexpr auto hparams_schema = option_schema(
      FULGUR_OPTION(string, dir, "Directory with the (gzipped) IDX files", "/usr/share/datasets/fashion-mnist"),
      FULGUR_OPTION(integer, batch_size, "Samples per batch", 64),
      FULGUR_OPTION(integer, num_workers, "Background threads assembling batches", 0),
      FULGUR_OPTION(integer, val_split, "Training images held out for validation (0: none)", 5000),
      FULGUR_OPTION(integer, seed, "Fixes the held-out images and the shuffling order", 42));

  explicit FashionMnistDataModule(Options hparams = {});

  void setup(Stage stage) override;
  std::unique_ptr<BatchLoader> train_loader() override;
  std::unique_ptr<BatchLoader> val_loader() override;
  std::unique_ptr<BatchLoader> test_loader() override;
  // The test images, in order.
  std::unique_ptr<BatchLoader> predict_loader() override;

  // The batch-size finder's handle (the next train_loader() uses a new size).
  int64_t batch_size() const override { return batch_size_; }
  void set_batch_size(int64_t n) override;
  // The splits as held: uint8 pixels [N, 28, 28] (a quarter of float32's bytes); the loaders
  // normalize each batch as they serve it, to what load_fashion_mnist returns.
  const FashionMnistSplit& train_split() const { return train_; }
  const FashionMnistSplit& val_split() const { return val_; }
  const FashionMnistSplit& test_split() const { return test_; }

 private:
  std::unique_ptr<BatchLoader> loader(const FashionMnistSplit& split, bool shuffle, const char* stage) const;

  std::filesystem::path dir_;
  int64_t batch_size_ = 64;
  int64_t num_workers_ = 0;
  int64_t val_count_ = 5000;
  uint64_t seed_ = 42;
  FashionMnistSplit train_, val_, test_;
};

// The optimizer hyperparameters both nets share, and the CNN's dropout.
#define FULGUR_FASHION_MNIST_OPTIMIZER_OPTIONS                                                    \
  FULGUR_OPTION(string, optimizer, "\"adam\", \"sgd\", \"lbfgs\", \"lion\" or \"muon\"", "adam"), \
      FULGUR_OPTION(floating, lr, "Learning rate", 1e-3),                                         \
      FULGUR_OPTION(floating, weight_decay, "L2 penalty of the optimizer", 0.0),                  \
      FULGUR_OPTION(floating, momentum, "SGD momentum (optimizer = \"sgd\" only)", 0.9),          \
      FULGUR_OPTION(integer, max_iter,                                                            \
                    "LBFGS evaluations per step, with a strong-Wolfe line search (optimizer = \"lbfgs\" only)", 20)
#define FULGUR_FASHION_MNIST_DROPOUT_OPTION \
  FULGUR_OPTION(floating, dropout, "Dropout after the convolutions and fc1", 0.25)

// Common steps of both classifiers. Their [model] hyperparameters are hparams_schema below; each
// net's plugin declares its own part of it (fashion_mnist_nets.h).
// training_step logs train/loss (progress bar); validation_step val/loss and val/acc (progress
// bar); test_step test/loss and test/acc; predict_step returns the logits [B, 10].
class FashionMnistClassifier : public Module {
 public:
  // Every key either net accepts when built in code (make_fashion_mnist_model); `arch` picks the
  // net there, and each net records its own.
  static constexpr auto hparams_schema =
      option_schema(FULGUR_OPTION(string, arch, "\"cnn\" or \"mlp\"", "cnn"), FULGUR_FASHION_MNIST_OPTIMIZER_OPTIONS,
                    FULGUR_FASHION_MNIST_DROPOUT_OPTION);

  // Checks `hparams` against hparams_schema (unknown keys refused with a suggestion) and fills in
  // the defaults.
  explicit FashionMnistClassifier(Options hparams);

  // Logits [B, 10] for images [B, 1, 28, 28].
  virtual at::Tensor forward(const at::Tensor& images) = 0;

  StepOutput training_step(const Batch& batch, int64_t batch_idx) override;
  StepOutput validation_step(const Batch& batch, int64_t batch_idx) override;
  StepOutput test_step(const Batch& batch, int64_t batch_idx) override;
  at::Tensor predict_step(const Batch& batch, int64_t batch_idx) override;
  std::vector<OptimizerConfig> configure_optimizers() override;

  // The optimizer configure_optimizers() returns, also used by the benchmark's hand-written loop
  // so that both sides step the same way.
  std::shared_ptr<torch::optim::Optimizer> make_optimizer();

 private:
  StepOutput evaluate(const Batch& batch, const char* loss_name, const char* acc_name, bool prog_bar);
};

// Builds the classifier that [model] arch names ("cnn" by default). Throws fulgur::Error(config)
// for an unknown arch or key, or a hyperparameter of the wrong type.
std::shared_ptr<FashionMnistClassifier> make_fashion_mnist_model(const Options& hparams);

}  // namespace fulgur::examples
