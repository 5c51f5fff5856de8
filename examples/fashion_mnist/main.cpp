// fashion_mnist: trains the Fashion-MNIST classifier that a TOML file describes, then tests it.
//
//   fashion_mnist [--config path/to/fashion_mnist.toml]
//
// Everything about the run (plugins, epochs, model and data hyperparameters) comes from the TOML;
// this file only wires a Module and a DataModule to the Trainer and reports the outcome.
#include "fashion_mnist.h"

#include <fulgur/callback.h>
#include <fulgur/error.h>
#include <fulgur/trainer.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#ifndef FULGUR_FASHION_MNIST_TOML
#define FULGUR_FASHION_MNIST_TOML "fashion_mnist.toml"
#endif

namespace {

using Clock = std::chrono::steady_clock;

// Wall time of each training epoch, end-of-epoch validation included (Lightning runs it before
// on_train_epoch_end).
class EpochTimer : public fulgur::Callback {
 public:
  fulgur::HookSet hooks() const override { return fulgur::Hook::train_epoch_start | fulgur::Hook::train_epoch_end; }
  void on_train_epoch_start(fulgur::TrainerContext&) override { start_ = Clock::now(); }
  void on_train_epoch_end(fulgur::TrainerContext&) override {
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start_).count());
  }
  std::vector<double> seconds;

 private:
  Clock::time_point start_;
};

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: fashion_mnist [--config FILE]\n"
               "Trains a Fashion-MNIST classifier with the Fulgur Trainer, then tests it.\n"
               "  --config FILE  run configuration (default: %s)\n",
               FULGUR_FASHION_MNIST_TOML);
}

int run(const std::filesystem::path& config_path) {
  namespace ex = fulgur::examples;
  fulgur::Trainer trainer = fulgur::Trainer::from_toml(config_path);
  // The model is built after the Trainer so that its initial weights follow [trainer] seed.
  std::shared_ptr<ex::FashionMnistClassifier> model;
  std::optional<ex::FashionMnistDataModule> data;
  try {
    // This program links the classes itself: [model] name picks the net the way the plugins
    // fashion_mnist_cnn / fashion_mnist_mlp do for `fulgur fit`.
    fulgur::Options hparams = trainer.config().model;
    const std::string& plugin = trainer.config().model_plugin.name;
    if (plugin == "fashion_mnist_mlp" || plugin == "fashion_mnist_cnn") hparams.set("arch", plugin.substr(14));
    model = ex::make_fashion_mnist_model(hparams);
    data.emplace(trainer.config().data);
  } catch (const fulgur::Error& e) {
    // [model] / [data] errors name the table and key; add the file they came from.
    if (e.kind() != fulgur::ErrorKind::config) throw;
    throw fulgur::Error(e.kind(), config_path.string() + ": " + e.what());
  }
  auto timer = std::make_shared<EpochTimer>();
  trainer.add_callback(timer);

  const Clock::time_point fit_start = Clock::now();
  trainer.fit(*model, *data);
  const double fit_seconds = std::chrono::duration<double>(Clock::now() - fit_start).count();
  const std::vector<fulgur::MetricMap> results = trainer.test(*model, *data);
  if (!trainer.is_global_zero()) return 0;  // ddp: rank 0 reports for all

  std::printf("\n");
  for (size_t i = 0; i < timer->seconds.size(); ++i)
    std::printf("epoch %zu: %.1f s (train + validation)\n", i, timer->seconds[i]);
  double sum = 0;
  for (double s : timer->seconds) sum += s;
  if (!timer->seconds.empty())
    std::printf("time per epoch: %.1f s (mean of %zu), fit: %.1f s\n", sum / timer->seconds.size(),
                timer->seconds.size(), fit_seconds);
  if (results.empty() || !results[0].count("test/acc")) {
    std::fprintf(stderr, "fashion_mnist: error: the test run reported no test/acc\n");
    return 1;
  }
  std::printf("test accuracy: %.2f%%  (test loss %.4f)\n", 100.0 * results[0].at("test/acc"),
              results[0].count("test/loss") ? results[0].at("test/loss") : 0.0);
  std::printf("logs and checkpoints: %s\n", trainer.log_dir().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path config = FULGUR_FASHION_MNIST_TOML;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(stdout);
      return 0;
    }
    if (arg == "--config" && i + 1 < argc) {
      config = argv[++i];
    } else if (arg.starts_with("--config=")) {
      config = std::string(arg.substr(9));
    } else {
      std::fprintf(stderr, "fashion_mnist: error: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  try {
    return run(config);
  } catch (const fulgur::Error& e) {
    std::fprintf(stderr, "fashion_mnist: error: %s\n", e.what());
  } catch (const std::exception& e) {
    // c10::Error and the like: not the user's input, but still a clean exit with the reason.
    std::fprintf(stderr, "fashion_mnist: internal error: %s\n", e.what());
  }
  return 1;
}
