// gpt: trains the small GPT that a TOML file describes, then samples text from it.
//
//   gpt [--config path/to/gpt.toml] [--predict [--ckpt PATH]]
//
// A temporary driver until `fulgur fit|predict --config` builds [model] and [data] itself: it
// only wires GptModel and CharCorpusDataModule to the Trainer and reports the outcome.
// --predict skips training and samples from a checkpoint (default "last": the newest last*.ckpt
// of the model_checkpoint callback, so the same TOML samples from what a previous run trained).
#include "gpt.h"

#include <fulgur/callback.h>
#include <fulgur/error.h>
#include <fulgur/trainer.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#ifndef FULGUR_GPT_TOML
#define FULGUR_GPT_TOML "gpt.toml"
#endif

namespace {

using Clock = std::chrono::steady_clock;

// Wall time of the optimizer steps: from each training batch's start to its end (validation runs
// outside these intervals, so it does not count).
class StepTimer : public fulgur::Callback {
 public:
  fulgur::HookSet hooks() const override { return fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end; }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override { start_ = Clock::now(); }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&, int64_t) override {
    const double s = std::chrono::duration<double>(Clock::now() - start_).count();
    // The first steps pay for allocations and kernel selection: keep them out of the mean.
    if (++steps > kWarmSteps) {
      seconds += s;
      ++timed;
    }
  }
  static constexpr int64_t kWarmSteps = 5;
  int64_t steps = 0, timed = 0;
  double seconds = 0;

 private:
  Clock::time_point start_;
};

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: gpt [--config FILE] [--predict [--ckpt PATH]]\n"
               "Trains a small GPT on a text corpus with the Fulgur Trainer, then samples text from it.\n"
               "  --config FILE  run configuration (default: %s)\n"
               "  --predict      only sample, from a checkpoint\n"
               "  --ckpt PATH    the checkpoint --predict loads: a file, \"last\" (default) or \"best\"\n",
               FULGUR_GPT_TOML);
}

int run(const std::filesystem::path& config_path, bool predict_only, const std::string& ckpt) {
  namespace ex = fulgur::examples;
  fulgur::Trainer trainer = fulgur::Trainer::from_toml(config_path);
  // The model is built after the Trainer so that its initial weights follow [trainer] seed.
  std::shared_ptr<ex::GptModel> model;
  std::optional<ex::CharCorpusDataModule> data;
  try {
    model = std::make_shared<ex::GptModel>(trainer.config().model);
    data.emplace(trainer.config().data);
  } catch (const fulgur::Error& e) {
    // [model] / [data] errors name the table and key; add the file they came from.
    if (e.kind() != fulgur::ErrorKind::config) throw;
    throw fulgur::Error(e.kind(), config_path.string() + ": " + e.what());
  }

  if (!predict_only) {
    auto timer = std::make_shared<StepTimer>();
    trainer.add_callback(timer);
    const Clock::time_point start = Clock::now();
    trainer.fit(*model, *data);
    const double fit_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (trainer.is_global_zero()) {
      // The last values sent to the loggers: train/loss of the last logged step, val/* of the last
      // validation.
      const fulgur::MetricMap& m = trainer.logged_metrics();
      auto value = [&](const char* key) { return m.count(key) ? m.at(key) : std::nan(""); };
      std::printf("\nsteps: %lld, fit: %.1f s, time per step: %.1f ms (mean of %lld after the first %lld)\n",
                  static_cast<long long>(trainer.global_step()), fit_seconds,
                  timer->timed > 0 ? 1000.0 * timer->seconds / static_cast<double>(timer->timed) : std::nan(""),
                  static_cast<long long>(timer->timed), static_cast<long long>(StepTimer::kWarmSteps));
      std::printf("train/loss %.4f  val/loss %.4f  val/ppl %.3f\n", value("train/loss"), value("val/loss"),
                  value("val/ppl"));
      std::printf("logs and checkpoints: %s\n\n", trainer.log_dir().c_str());
      std::fflush(stdout);
    }
  }
  // predict_step prints each sample (print_samples = true in [model]).
  trainer.predict(*model, *data, predict_only ? ckpt : std::string());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path config = FULGUR_GPT_TOML;
  bool predict_only = false;
  std::string ckpt = "last";
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
    } else if (arg == "--predict") {
      predict_only = true;
    } else if (arg == "--ckpt" && i + 1 < argc) {
      ckpt = argv[++i];
    } else {
      std::fprintf(stderr, "gpt: error: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  try {
    return run(config, predict_only, ckpt);
  } catch (const fulgur::Error& e) {
    std::fprintf(stderr, "gpt: error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: internal error: %s\n", e.what());
  }
  return 1;
}
