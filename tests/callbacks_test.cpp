// The built-in callbacks (model_checkpoint, early_stopping, progress_bar, model_summary), loaded
// through the registry as the Trainer loads them and driven by a fake Trainer whose metrics,
// counters and collectives the test controls. Each case asserts what a user would notice if it
// broke: which files exist, what the checkpoint state says, when training stops and why, and what
// gets printed.
#include <fulgur/callback.h>
#include <fulgur/error.h>
#include <fulgur/registry/registry.h>
#include <fulgur/testing.h>
#include <fulgur/trainer_context.h>

#include <ATen/core/ivalue.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "test_support.h"

namespace {

using fulgur::Callback;
using fulgur::Error;
using fulgur::ErrorKind;
using fulgur::MetricMap;
using fulgur::Stage;
using fulgur::test::TempDir;
namespace fs = std::filesystem;

// ---- plugins, as the Trainer creates them ---------------------------------------------------------

fulgur::PluginRegistry& registry() {
  static fulgur::PluginRegistry instance(fulgur::plugin_search_path({}));
  return instance;
}

using Overrides = std::vector<std::pair<std::string, fulgur::OptionValue>>;

// The plugin's schema defaults (read from its metadata) with `overrides` on top.
fulgur::Options options_for(std::string_view name, const Overrides& overrides) {
  const fulgur::PluginCandidate& candidate = registry().resolve(fulgur::PluginKind::callback, name);
  fulgur::Options options(fmt::format("callback '{}'", name));
  for (const auto& option : candidate.metadata.options)
    if (option.default_value) options.set(option.key, *option.default_value);
  for (const auto& [key, value] : overrides) {
    REQUIRE_MESSAGE(candidate.metadata.find_option(key) != nullptr, name << " has no option " << key);
    options.set(key, value);
  }
  return options;
}

std::shared_ptr<Callback> make_callback(std::string_view name, const Overrides& overrides = {}) {
  return fulgur::plugin_cast<Callback>(
      registry().create(fulgur::PluginKind::callback, name, options_for(name, overrides)));
}

fulgur::OptionValue str(const char* s) { return std::string(s); }
fulgur::OptionValue integer(int64_t i) { return i; }
fulgur::OptionValue real(double d) { return d; }
fulgur::OptionValue boolean(bool b) { return b; }

// ---- a Trainer the test controls ----------------------------------------------------------------

// The testing kit's FakeTrainer, with a std::filesystem root for these tests' convenience.
struct FakeTrainer : fulgur::testing::FakeTrainer {
  explicit FakeTrainer(const fs::path& root = {}) : fulgur::testing::FakeTrainer(root.string()) {}
};

// ---- helpers ----------------------------------------------------------------------------------------

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> names;
  if (!fs::exists(dir)) return names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

c10::impl::GenericDict state_of(const Callback& callback) {
  c10::IValue state;
  callback.state_dict(state);
  REQUIRE(state.isGenericDict());
  return state.toGenericDict();
}

std::string string_at(const c10::impl::GenericDict& dict, const std::string& key) {
  auto it = dict.find(key);
  REQUIRE_MESSAGE(it != dict.end(), "state has no key " << key);
  REQUIRE_MESSAGE(it->value().isString(), key << " is not a string");
  return it->value().toStringRef();
}

double number_at(const c10::impl::GenericDict& dict, const std::string& key) {
  auto it = dict.find(key);
  REQUIRE_MESSAGE(it != dict.end(), "state has no key " << key);
  const c10::IValue& v = it->value();
  if (v.isTensor()) return v.toTensor().item<double>();
  if (v.isInt()) return static_cast<double>(v.toInt());
  REQUIRE_MESSAGE(v.isDouble(), key << " is not a number");
  return v.toDouble();
}

// stdout of the code run inside, read back from a temporary file (fd-level, as the plugins use C stdio).
template <class F>
std::string capture_stdout(F&& run) {
  TempDir dir;
  fs::path file = dir / "stdout.txt";
  std::fflush(stdout);
  int saved = ::dup(STDOUT_FILENO);
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  ::dup2(fd, STDOUT_FILENO);
  ::close(fd);
  try {
    run();
  } catch (...) {
    std::fflush(stdout);
    ::dup2(saved, STDOUT_FILENO);
    ::close(saved);
    throw;
  }
  std::fflush(stdout);
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  return fulgur::test::read_bytes(file);
}

// spdlog output (the default logger, shared with the plugins through libspdlog) while `run` runs.
template <class F>
std::string capture_log(F&& run) {
  std::ostringstream out;
  auto previous = spdlog::default_logger();
  auto logger = std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_st>(out));
  logger->set_pattern("%v");
  spdlog::set_default_logger(logger);
  try {
    run();
  } catch (...) {
    spdlog::set_default_logger(previous);
    throw;
  }
  spdlog::set_default_logger(previous);
  return out.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

// ================================ model_checkpoint ================================================

TEST_CASE("model_checkpoint renders file names like Lightning, with '/' in metric names made '_'") {
  TempDir dir;
  SUBCASE("default {epoch}-{step}") {
    auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}});
    FakeTrainer trainer;
    trainer.start_fit(*cb);
    trainer.epoch = 3;
    trainer.run_epoch(*cb, {{"val/loss", 0.5}}, 120);
    REQUIRE(trainer.saves.size() == 1);
    CHECK(trainer.saves[0].first == (dir / "epoch=3-step=120.ckpt").string());
    CHECK(trainer.saves[0].second == false);
  }
  SUBCASE("metric placeholders with format specs") {
    auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())},
                                                 {"filename", str("{epoch}-{val/acc:.4f}")},
                                                 {"monitor", str("val/acc")},
                                                 {"mode", str("max")},
                                                 {"save_weights_only", boolean(true)}});
    FakeTrainer trainer;
    trainer.start_fit(*cb);
    trainer.epoch = 3;
    trainer.run_epoch(*cb, {{"val/acc", 0.912345}});
    REQUIRE(trainer.saves.size() == 1);
    CHECK(trainer.saves[0].first == (dir / "epoch=3-val_acc=0.9123.ckpt").string());
    CHECK(trainer.saves[0].second == true);
    CHECK(fs::exists(dir / "epoch=3-val_acc=0.9123.ckpt"));
  }
  SUBCASE("auto_insert_metric_name = false, integer and percent specs") {
    auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())},
                                                 {"filename", str("run_{epoch:02d}_{val/acc:.1%}_{missing}")},
                                                 {"auto_insert_metric_name", boolean(false)}});
    FakeTrainer trainer;
    trainer.start_fit(*cb);
    trainer.epoch = 7;
    trainer.run_epoch(*cb, {{"val/acc", 0.912}});
    REQUIRE(trainer.saves.size() == 1);
    // As in Lightning, a placeholder for a metric that was never logged renders as 0.
    CHECK(trainer.saves[0].first == (dir / "run_07_91.2%_0.ckpt").string());
  }
  SUBCASE("a malformed template fails at creation, not after an epoch") {
    auto error = fulgur::test::error_from([&] {
      make_callback("model_checkpoint", {{"filename", str("{epoch-{step}")}});
    });
    CHECK(error.kind() == ErrorKind::plugin_create);
    FULGUR_CHECK_CONTAINS(std::string(error.what()), "filename");
  }
}

TEST_CASE("model_checkpoint keeps the best k by the monitor and deletes the files that fall out") {
  TempDir dir;
  auto cb =
      make_callback("model_checkpoint",
                    {{"dirpath", str(dir.path().c_str())}, {"monitor", str("val/loss")}, {"save_top_k", integer(2)}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  for (double loss : {0.5, 0.4, 0.6, 0.3, 0.45}) trainer.run_epoch(*cb, {{"val/loss", loss}});

  // 0.6 and 0.45 were never good enough to be written; 0.5 was pushed out by 0.3.
  std::vector<std::string> written;
  for (const auto& [path, weights_only] : trainer.saves) written.push_back(fs::path(path).filename().string());
  CHECK(written == std::vector<std::string>{"epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "epoch=3-step=40.ckpt"});
  CHECK(files_in(dir.path()) == std::vector<std::string>{"epoch=1-step=20.ckpt", "epoch=3-step=40.ckpt"});

  auto state = state_of(*cb);
  CHECK(string_at(state, "best_model_path") == (dir / "epoch=3-step=40.ckpt").string());
  CHECK(number_at(state, "best_model_score") == doctest::Approx(0.3));
  CHECK(string_at(state, "kth_best_model_path") == (dir / "epoch=1-step=20.ckpt").string());
  CHECK(number_at(state, "kth_value") == doctest::Approx(0.4));
  CHECK(number_at(state, "current_score") == doctest::Approx(0.3));
  CHECK(state.at("best_k_models").toGenericDict().size() == 2);
  // Ranks agree on "better than the k-th" with all = true (Lightning's default).
  REQUIRE(!trainer.decisions.empty());
  CHECK(trainer.decisions.front().second == true);
}

TEST_CASE("model_checkpoint mode = max and save_top_k = -1 keep everything, best is the highest") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())},
                                               {"monitor", str("val/acc")},
                                               {"mode", str("max")},
                                               {"save_top_k", integer(-1)}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  for (double acc : {0.7, 0.9, 0.8}) trainer.run_epoch(*cb, {{"val/acc", acc}});
  CHECK(files_in(dir.path()).size() == 3);
  auto state = state_of(*cb);
  CHECK(string_at(state, "best_model_path") == (dir / "epoch=1-step=20.ckpt").string());
  CHECK(number_at(state, "best_model_score") == doctest::Approx(0.9));
}

TEST_CASE("model_checkpoint without monitor keeps the latest, and save_last rewrites last.ckpt") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}, {"save_last", boolean(true)}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  trainer.run_epoch(*cb, {});
  trainer.run_epoch(*cb, {});
  CHECK(files_in(dir.path()) == std::vector<std::string>{"epoch=1-step=20.ckpt", "last.ckpt"});
  CHECK(trainer.saves.size() == 4);  // top-1 and last at each of the two epochs
  auto state = state_of(*cb);
  CHECK(string_at(state, "best_model_path") == (dir / "epoch=1-step=20.ckpt").string());
  CHECK(string_at(state, "last_model_path") == (dir / "last.ckpt").string());
  CHECK(state.at("best_model_score").isNone());
  CHECK(state.at("monitor").isNone());
}

TEST_CASE("model_checkpoint never overwrites an older run's file: it appends -v1") {
  TempDir dir;
  std::ofstream(dir / "epoch=0-step=10.ckpt") << "from an earlier run";
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  trainer.run_epoch(*cb, {});
  trainer.run_epoch(*cb, {});
  // The earlier run's file is left alone; this run's first file was replaced by its second.
  CHECK(files_in(dir.path()) == std::vector<std::string>{"epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt"});
  CHECK(trainer.saves[0].first == (dir / "epoch=0-step=10-v1.ckpt").string());
  CHECK(fulgur::test::read_bytes(dir / "epoch=0-step=10.ckpt") == "from an earlier run");
}

TEST_CASE("model_checkpoint resolves the default directory under log_dir, through rank zero's broadcast") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint");
  FakeTrainer trainer(dir.path());
  trainer.start_fit(*cb);
  CHECK(trainer.broadcasts >= 1);
  trainer.run_epoch(*cb, {});
  REQUIRE(trainer.saves.size() == 1);
  CHECK(trainer.saves[0].first == (dir / "checkpoints" / "epoch=0-step=10.ckpt").string());
  CHECK(string_at(state_of(*cb), "dirpath") == (dir / "checkpoints").string());
}

TEST_CASE("model_checkpoint every_n_train_steps saves on steps only, once per step, and only in fit") {
  TempDir dir;
  auto cb =
      make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}, {"every_n_train_steps", integer(2)}});
  CHECK(fulgur::has_hook(cb->hooks(), fulgur::Hook::train_batch_end));
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  fulgur::StepOutput output;
  fulgur::Batch batch;
  for (int64_t i = 0; i < 5; ++i) {
    trainer.step = i + 1;
    cb->on_train_batch_end(trainer, output, batch, i);
    cb->on_train_batch_end(trainer, output, batch, i);  // accumulation: same global step again
  }
  // every_n_epochs defaults to 0 once steps are set (Lightning): the epoch end adds nothing.
  trainer.run_epoch(*cb, {}, 0);
  std::vector<std::string> written;
  for (const auto& [path, w] : trainer.saves) written.push_back(fs::path(path).filename().string());
  CHECK(written == std::vector<std::string>{"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"});
  CHECK(cb->state_key() ==
        "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 2, 'every_n_epochs': 0, "
        "'train_time_interval': None}");

  SUBCASE("the per-batch hook is not even declared when saving by epoch") {
    auto by_epoch = make_callback("model_checkpoint");
    CHECK_FALSE(fulgur::has_hook(by_epoch->hooks(), fulgur::Hook::train_batch_end));
  }
}

TEST_CASE("model_checkpoint saves nothing in the sanity check or outside fit") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  trainer.step = 5;
  trainer.sanity = true;
  cb->on_validation_end(trainer);
  trainer.sanity = false;
  CHECK(trainer.saves.empty());

  cb->teardown(trainer, Stage::fit);
  trainer.stage_value = Stage::validate;
  cb->setup(trainer, Stage::validate);
  cb->on_validation_end(trainer);
  CHECK(trainer.saves.empty());
}

TEST_CASE("model_checkpoint without validation saves at the end of the training epoch") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}, {"monitor", str("train/loss")}});
  FakeTrainer trainer;
  trainer.batches[Stage::validate] = 0;
  trainer.start_fit(*cb);
  trainer.step = 10;
  trainer.metrics = {{"train/loss", 1.5}};
  cb->on_train_epoch_end(trainer);
  REQUIRE(trainer.saves.size() == 1);
  CHECK(trainer.saves[0].first == (dir / "epoch=0-step=10.ckpt").string());
}

TEST_CASE("model_checkpoint: a monitored metric that is never logged is a config error naming what is there") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}, {"monitor", str("val/acc")}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  trainer.step = 10;
  trainer.metrics = {{"val/accuracy", 0.9}, {"train/loss", 0.3}};
  auto error = fulgur::test::error_from([&] { cb->on_validation_end(trainer); });
  CHECK(error.kind() == ErrorKind::config);
  std::string message = error.what();
  FULGUR_CHECK_CONTAINS(message, "\"val/acc\"");
  FULGUR_CHECK_CONTAINS(message, "\"train/loss\"");
  FULGUR_CHECK_CONTAINS(message, "Did you mean \"val/accuracy\"?");
  CHECK(trainer.saves.empty());
}

TEST_CASE("model_checkpoint: a step-triggered save waits for validation to log the monitored metric") {
  TempDir dir;
  auto cb = make_callback(
      "model_checkpoint",
      {{"dirpath", str(dir.path().c_str())}, {"monitor", str("val/loss")}, {"every_n_train_steps", integer(3)}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  trainer.step = 3;
  trainer.metrics = {{"train/loss", 0.7}};
  cb->on_train_batch_end(trainer, {}, {}, 2);
  CHECK(trainer.saves.empty());
  trainer.metrics["val/loss"] = 0.25;
  cb->on_validation_end(trainer);
  REQUIRE(trainer.saves.size() == 1);
  CHECK(trainer.saves[0].first == (dir / "epoch=0-step=3.ckpt").string());
}

TEST_CASE("model_checkpoint state_dict round-trips best/last paths and the top k") {
  TempDir dir;
  Overrides options{{"dirpath", str(dir.path().c_str())},
                    {"monitor", str("val/acc")},
                    {"mode", str("max")},
                    {"save_top_k", integer(2)},
                    {"save_last", boolean(true)}};
  auto first = make_callback("model_checkpoint", options);
  CHECK(first->state_key() ==
        "ModelCheckpoint{'monitor': 'val/acc', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, "
        "'train_time_interval': None}");
  FakeTrainer trainer;
  trainer.start_fit(*first);
  trainer.run_epoch(*first, {{"val/acc", 0.6}});
  trainer.run_epoch(*first, {{"val/acc", 0.8}});
  c10::IValue saved;
  first->state_dict(saved);
  auto state = saved.toGenericDict();
  for (const char* key : {"monitor", "best_model_score", "best_model_path", "current_score", "dirpath", "best_k_models",
                          "kth_best_model_path", "kth_value", "last_model_path"})
    CHECK_MESSAGE(state.contains(key), "missing key " << key);
  CHECK(string_at(state, "monitor") == "val/acc");
  CHECK(string_at(state, "last_model_path") == (dir / "last.ckpt").string());

  SUBCASE("restored into a new run in the same directory") {
    auto resumed = make_callback("model_checkpoint", options);
    resumed->setup(trainer, Stage::fit);
    resumed->load_state_dict(saved);  // the core restores callbacks before on_fit_start
    resumed->on_fit_start(trainer);
    auto restored = state_of(*resumed);
    CHECK(string_at(restored, "best_model_path") == (dir / "epoch=1-step=20.ckpt").string());
    CHECK(string_at(restored, "kth_best_model_path") == (dir / "epoch=0-step=10.ckpt").string());
    CHECK(string_at(restored, "last_model_path") == (dir / "last.ckpt").string());
    CHECK(restored.at("best_k_models").toGenericDict().size() == 2);

    // The restored ranking is live: 0.7 beats the k-th (0.6), whose file is deleted; last.ckpt is
    // rewritten under the same name instead of becoming last-v1.ckpt.
    trainer.run_epoch(*resumed, {{"val/acc", 0.7}});
    CHECK(files_in(dir.path()) ==
          std::vector<std::string>{"epoch=1-step=20.ckpt", "epoch=2-step=30.ckpt", "last.ckpt"});
    CHECK(string_at(state_of(*resumed), "best_model_path") == (dir / "epoch=1-step=20.ckpt").string());
  }
  SUBCASE("restored into a run with another directory: only best_model_path comes back") {
    TempDir other;
    Overrides moved = options;
    moved[0] = {"dirpath", str(other.path().c_str())};
    auto resumed = make_callback("model_checkpoint", moved);
    resumed->load_state_dict(saved);
    resumed->setup(trainer, Stage::fit);
    resumed->on_fit_start(trainer);
    auto restored = state_of(*resumed);
    CHECK(string_at(restored, "best_model_path") == (dir / "epoch=1-step=20.ckpt").string());
    CHECK(string_at(restored, "last_model_path").empty());
    CHECK(restored.at("best_k_models").toGenericDict().size() == 0);
  }
}

TEST_CASE("model_checkpoint: a failed write leaves best/last naming files that exist") {
  TempDir dir;
  auto cb = make_callback("model_checkpoint", {{"dirpath", str(dir.path().c_str())}, {"monitor", str("val/loss")}});
  FakeTrainer trainer;
  trainer.start_fit(*cb);
  trainer.run_epoch(*cb, {{"val/loss", 0.5}});
  trainer.fail_saves = true;
  CHECK_THROWS_AS(trainer.run_epoch(*cb, {{"val/loss", 0.1}}), Error);
  auto state = state_of(*cb);
  CHECK(string_at(state, "best_model_path") == (dir / "epoch=0-step=10.ckpt").string());
  CHECK(number_at(state, "best_model_score") == doctest::Approx(0.5));
  CHECK(files_in(dir.path()) == std::vector<std::string>{"epoch=0-step=10.ckpt"});
}

TEST_CASE("model_checkpoint rejects configurations Lightning rejects") {
  auto message = [](const Overrides& o) {
    return std::string(fulgur::test::error_from([&] { make_callback("model_checkpoint", o); }).what());
  };
  FULGUR_CHECK_CONTAINS(message({{"save_top_k", integer(3)}}), "needs a `monitor`");
  FULGUR_CHECK_CONTAINS(message({{"save_top_k", integer(-2)}}), "save_top_k = -2");
  FULGUR_CHECK_CONTAINS(message({{"mode", str("maximum")}}), "mode = \"maximum\"");
  FULGUR_CHECK_CONTAINS(message({{"every_n_train_steps", integer(-1)}}), "every_n_train_steps");
}

// ================================ early_stopping ==================================================

namespace {
// One validation check per value, as the fit loop would run them; returns the check that stopped.
int checks_until_stop(Callback& cb, FakeTrainer& trainer, const std::string& metric, std::vector<double> values) {
  trainer.start_fit(cb);
  for (size_t i = 0; i < values.size(); ++i) {
    trainer.run_epoch(cb, {{metric, values[i]}});
    if (trainer.should_stop()) return static_cast<int>(i);
  }
  return -1;
}
}  // namespace

TEST_CASE("early_stopping: patience counts checks without an improvement larger than min_delta") {
  auto cb = make_callback("early_stopping",
                          {{"monitor", str("val/loss")}, {"patience", integer(2)}, {"min_delta", real(0.1)}});
  FakeTrainer trainer;
  // 0.95 is better than 1.0 but by less than min_delta: no improvement. 0.85 is one (< 0.9).
  CHECK(checks_until_stop(*cb, trainer, "val/loss", {1.0, 0.95, 0.85, 0.8, 0.79, 0.5}) == 4);
  REQUIRE(trainer.stop_reasons.size() == 1);
  CHECK(trainer.stop_reasons[0] ==
        "Monitored metric val/loss did not improve in the last 2 records. Best score: 0.850. Signaling Trainer to "
        "stop.");
  auto state = state_of(*cb);
  CHECK(number_at(state, "wait_count") == 2);
  CHECK(number_at(state, "stopped_epoch") == 4);
  CHECK(number_at(state, "best_score") == doctest::Approx(0.85));
  CHECK(number_at(state, "patience") == 2);
  // Any rank that wants to stop stops all (Lightning reduces with all = false).
  REQUIRE(!trainer.decisions.empty());
  CHECK(trainer.decisions.back() == std::pair<bool, bool>{true, false});
}

TEST_CASE("early_stopping: mode = max, an improvement resets the count") {
  auto cb =
      make_callback("early_stopping", {{"monitor", str("val/acc")}, {"mode", str("max")}, {"patience", integer(2)}});
  FakeTrainer trainer;
  CHECK(checks_until_stop(*cb, trainer, "val/acc", {0.5, 0.4, 0.6, 0.55, 0.6, 0.7}) == 4);
  CHECK(
      trainer.stop_reasons.at(0) ==
      "Monitored metric val/acc did not improve in the last 2 records. Best score: 0.600. Signaling Trainer to stop.");
}

TEST_CASE("early_stopping: stopping and divergence thresholds") {
  SUBCASE("stopping_threshold, mode max") {
    auto cb = make_callback("early_stopping",
                            {{"monitor", str("val/acc")}, {"mode", str("max")}, {"stopping_threshold", real(0.9)}});
    FakeTrainer trainer;
    CHECK(checks_until_stop(*cb, trainer, "val/acc", {0.5, 0.9, 0.95}) == 2);  // 0.9 is not better than 0.9
    CHECK(trainer.stop_reasons.at(0) == "Stopping threshold reached: val/acc = 0.95 > 0.9. Signaling Trainer to stop.");
  }
  SUBCASE("divergence_threshold, mode min") {
    auto cb = make_callback("early_stopping", {{"monitor", str("val/loss")}, {"divergence_threshold", real(5.0)}});
    FakeTrainer trainer;
    CHECK(checks_until_stop(*cb, trainer, "val/loss", {1.0, 4.0, 6.5}) == 2);
    CHECK(trainer.stop_reasons.at(0) ==
          "Divergence threshold reached: val/loss = 6.5 > 5.0. Signaling Trainer to stop.");
  }
  SUBCASE("the defaults (nan) mean no threshold") {
    auto cb = make_callback("early_stopping", {{"monitor", str("val/loss")}, {"patience", integer(100)}});
    FakeTrainer trainer;
    CHECK(checks_until_stop(*cb, trainer, "val/loss", {1e9, -1e9, 1e12}) == -1);
  }
}

TEST_CASE("early_stopping: a non-finite metric stops at once unless check_finite = false") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  SUBCASE("check_finite") {
    auto cb = make_callback("early_stopping", {{"monitor", str("val/loss")}});
    FakeTrainer trainer;
    CHECK(checks_until_stop(*cb, trainer, "val/loss", {0.5, nan}) == 1);
    CHECK(trainer.stop_reasons.at(0) ==
          "Monitored metric val/loss = nan is not finite. Previous best value was 0.500. Signaling Trainer to stop.");
  }
  SUBCASE("check_finite = false: NaN is just no improvement") {
    auto cb = make_callback("early_stopping",
                            {{"monitor", str("val/loss")}, {"check_finite", boolean(false)}, {"patience", integer(2)}});
    FakeTrainer trainer;
    CHECK(checks_until_stop(*cb, trainer, "val/loss", {0.5, nan, nan}) == 2);
  }
}

TEST_CASE("early_stopping: a missing monitor is an error when strict, skipped otherwise") {
  FakeTrainer trainer;
  trainer.metrics = {{"val_loss", 0.4}};
  auto strict = make_callback("early_stopping", {{"monitor", str("val/loss")}});
  strict->setup(trainer, Stage::fit);
  auto error = fulgur::test::error_from([&] { strict->on_validation_end(trainer); });
  CHECK(error.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(std::string(error.what()), "\"val/loss\"");
  FULGUR_CHECK_CONTAINS(std::string(error.what()), "Did you mean \"val_loss\"?");

  auto lenient = make_callback("early_stopping", {{"monitor", str("val/loss")}, {"strict", boolean(false)}});
  lenient->setup(trainer, Stage::fit);
  lenient->on_validation_end(trainer);
  CHECK_FALSE(trainer.should_stop());
}

TEST_CASE("early_stopping checks where it should: after validation, not in the sanity check") {
  auto cb = make_callback("early_stopping", {{"monitor", str("val/loss")}, {"patience", integer(0)}});
  FakeTrainer trainer;
  cb->setup(trainer, Stage::fit);
  trainer.metrics = {{"val/loss", 1.0}};
  trainer.sanity = true;
  cb->on_validation_end(trainer);
  trainer.sanity = false;
  cb->on_train_epoch_end(trainer);  // validation runs in this fit: the epoch end is not a check
  CHECK(number_at(state_of(*cb), "best_score") == std::numeric_limits<double>::infinity());
  cb->on_validation_end(trainer);
  CHECK(number_at(state_of(*cb), "best_score") == 1.0);

  SUBCASE("without validation, the training epoch end is the check") {
    auto no_val = make_callback("early_stopping", {{"monitor", str("train/loss")}, {"patience", integer(1)}});
    FakeTrainer t;
    t.batches[Stage::validate] = 0;
    no_val->setup(t, Stage::fit);
    t.metrics = {{"train/loss", 1.0}};
    no_val->on_train_epoch_end(t);
    no_val->on_train_epoch_end(t);
    CHECK(t.should_stop());
  }
}

TEST_CASE("early_stopping stops this rank when another rank decided to") {
  auto cb = make_callback("early_stopping", {{"monitor", str("val/loss")}});
  FakeTrainer trainer;
  trainer.forced_decision = true;
  trainer.start_fit(*cb);
  trainer.run_epoch(*cb, {{"val/loss", 0.5}});
  CHECK(trainer.should_stop());
  CHECK(trainer.decisions.back() == std::pair<bool, bool>{false, false});
}

TEST_CASE("early_stopping state round-trips and the restored run keeps counting") {
  Overrides options{{"monitor", str("val/loss")}, {"patience", integer(3)}};
  auto first = make_callback("early_stopping", options);
  CHECK(first->state_key() == "EarlyStopping{'monitor': 'val/loss', 'mode': 'min'}");
  FakeTrainer trainer;
  CHECK(checks_until_stop(*first, trainer, "val/loss", {0.4, 0.5, 0.6}) == -1);  // wait_count 2
  c10::IValue saved;
  first->state_dict(saved);

  auto resumed = make_callback("early_stopping", options);
  resumed->load_state_dict(saved);
  FakeTrainer again;
  again.start_fit(*resumed);
  again.run_epoch(*resumed, {{"val/loss", 0.45}});  // third check without improving on 0.4
  CHECK(again.stop_reasons.at(0) ==
        "Monitored metric val/loss did not improve in the last 3 records. Best score: 0.400. Signaling Trainer to "
        "stop.");
}

// ================================ progress_bar ====================================================

TEST_CASE("progress_bar without a terminal prints plain lines at the interval and at epoch end") {
  auto cb = make_callback("progress_bar", {{"style", str("plain")}, {"log_interval", integer(2)}});
  FakeTrainer trainer;
  trainer.bar_metrics = {{"loss", 0.31234}, {"val/acc", 0.91}};
  fulgur::StepOutput output;
  fulgur::Batch batch;
  std::string quiet_batch;
  std::string out = capture_stdout([&] {
    cb->on_train_epoch_start(trainer);
    quiet_batch = capture_stdout([&] { cb->on_train_batch_end(trainer, output, batch, 0); });
    for (int64_t i = 1; i < 5; ++i) cb->on_train_batch_end(trainer, output, batch, i);
    cb->on_validation_start(trainer);
    cb->on_validation_batch_end(trainer, output, batch, 0);
    cb->on_validation_batch_end(trainer, output, batch, 1);
    cb->on_validation_end(trainer);
    cb->on_train_epoch_end(trainer);
    cb->on_train_end(trainer);
  });
  // A batch that is not printed does nothing visible and does not even read the metrics.
  CHECK(quiet_batch.empty());
  auto lines = lines_of(out);
  REQUIRE_MESSAGE(lines.size() == 3, out);
  CHECK(lines[0].starts_with("Epoch 0/2:  40% 2/5 [00:00<00:00, "));
  FULGUR_CHECK_CONTAINS(lines[0], "loss=0.312, val/acc=0.91]");
  CHECK(lines[1].starts_with("Epoch 0/2:  80% 4/5 ["));
  // The last batch is reported by the epoch's line, which comes after validation (a validation
  // inside fit has no closing line of its own: the epoch line carries its metrics).
  CHECK(lines[2].starts_with("Epoch 0/2: 100% 5/5 ["));
  FULGUR_CHECK_CONTAINS(lines[2], "it/s, loss=0.312, val/acc=0.91]");
  CHECK(trainer.progress_bar_reads == 3);  // only for the printed lines
}

TEST_CASE("progress_bar prints one line per evaluation stage and nothing in the sanity check") {
  auto cb = make_callback("progress_bar", {{"style", str("plain")}});
  FakeTrainer trainer;
  trainer.batches[Stage::test] = 3;
  trainer.batches[Stage::predict] = -1;  // a loader of unknown length
  std::string out = capture_stdout([&] {
    trainer.sanity = true;
    cb->on_validation_start(trainer);
    cb->on_validation_batch_end(trainer, {}, {}, 0);
    cb->on_validation_end(trainer);
    trainer.sanity = false;
    trainer.stage_value = Stage::test;
    cb->on_test_start(trainer);
    for (int64_t i = 0; i < 3; ++i) cb->on_test_batch_end(trainer, {}, {}, i);
    cb->on_test_end(trainer);
    trainer.stage_value = Stage::predict;
    cb->on_predict_start(trainer);
    for (int64_t i = 0; i < 4; ++i) cb->on_predict_batch_end(trainer, at::Tensor(), {}, i);
    cb->on_predict_end(trainer);
  });
  auto lines = lines_of(out);
  REQUIRE_MESSAGE(lines.size() == 2, out);
  CHECK(lines[0].starts_with("Testing: 100% 3/3 [00:00<00:00, "));
  CHECK(lines[1].starts_with("Predicting: 4it [00:00, "));
}

TEST_CASE("progress_bar prints only on rank zero") {
  auto cb = make_callback("progress_bar", {{"style", str("plain")}, {"log_interval", integer(1)}});
  FakeTrainer trainer;
  trainer.cluster_info.global_rank = 1;
  trainer.cluster_info.world_size = 2;
  std::string out = capture_stdout([&] {
    cb->on_train_epoch_start(trainer);
    for (int64_t i = 0; i < 5; ++i) cb->on_train_batch_end(trainer, {}, {}, i);
    cb->on_train_epoch_end(trainer);
    cb->on_train_end(trainer);
  });
  CHECK(out.empty());
}

TEST_CASE("progress_bar live style redraws one line in place and ends it with a newline") {
  auto cb = make_callback("progress_bar", {{"style", str("bar")}});
  FakeTrainer trainer;
  trainer.max_epochs_value = 10;
  trainer.epoch = 3;
  trainer.bar_metrics = {{"loss", 0.25}};
  std::string out = capture_stdout([&] {
    cb->on_train_epoch_start(trainer);
    for (int64_t i = 0; i < 5; ++i) cb->on_train_batch_end(trainer, {}, {}, i);
    cb->on_train_epoch_end(trainer);
    cb->on_train_end(trainer);
  });
  CHECK(out.starts_with("\rEpoch 3/9:   0%|"));
  FULGUR_CHECK_CONTAINS(out, "\rEpoch 3/9: 100%|");
  FULGUR_CHECK_CONTAINS(out, "█");
  FULGUR_CHECK_CONTAINS(out, "| 5/5 [");
  FULGUR_CHECK_CONTAINS(out, "loss=0.25]");
  CHECK(out.ends_with("\n"));
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);  // one line, redrawn

  SUBCASE("refresh_rate = 0 turns the bar off entirely") {
    CHECK(make_callback("progress_bar", {{"style", str("bar")}, {"refresh_rate", integer(0)}})->hooks() == 0);
  }
}

// ================================ model_summary ===================================================

TEST_CASE("model_summary logs Lightning's table with parameter counts, modes and size") {
  auto cb = make_callback("model_summary");
  FakeTrainer trainer;
  torch::nn::Sequential model(torch::nn::Linear(10, 20), torch::nn::ReLU(), torch::nn::Linear(20, 5));
  model[2]->eval();
  model[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
  trainer.module = model.ptr();
  std::string log = capture_log([&] { cb->on_fit_start(trainer); });
  // 10*20+20 = 220 and 20*5+5 = 105 parameters; 20 frozen; 325 float32 = 1300 bytes.
  CHECK(log ==
        "\n"
        "  | Name | Type   | Params | Mode \n"
        "----------------------------------------\n"
        "0 | 0    | Linear | 220    | train\n"
        "1 | 1    | ReLU   | 0      | train\n"
        "2 | 2    | Linear | 105    | eval \n"
        "----------------------------------------\n"
        "305       Trainable params\n"
        "20        Non-trainable params\n"
        "325       Total params\n"
        "0.001     Total estimated model params size (MB)\n"
        "2         Modules in train mode\n"
        "1         Modules in eval mode\n");
}

namespace {
struct Backbone : torch::nn::Module {
  Backbone() {
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(100, 1000), torch::nn::Linear(1000, 10)));
    scale = register_parameter("scale", torch::ones({7}));
  }
  torch::nn::Sequential net{nullptr};
  at::Tensor scale;
};
}  // namespace

TEST_CASE("model_summary max_depth lists nested modules, big counts abbreviated, root parameters apart") {
  auto cb = make_callback("model_summary", {{"max_depth", integer(2)}});
  FakeTrainer trainer;
  trainer.module = std::make_shared<Backbone>();
  std::string log = capture_log([&] { cb->on_fit_start(trainer); });
  auto lines = lines_of(log);
  REQUIRE_MESSAGE(lines.size() == 14, log);
  // 100*1000+1000 = 101000 -> "101 K"; 1000*10+10 = 10010 -> "10.0 K"; `scale` (7) sits on the root.
  CHECK(lines[1] == "  | Name         | Type       | Params | Mode ");
  CHECK(lines[3] == "0 | net          | Sequential | 111 K  | train");
  CHECK(lines[4] == "1 | net.0        | Linear     | 101 K  | train");
  CHECK(lines[5] == "2 | net.1        | Linear     | 10.0 K | train");
  CHECK(lines[6] == "  | other params | n/a        | 7      | n/a  ");
  FULGUR_CHECK_CONTAINS(log, "111 K     Total params");
  FULGUR_CHECK_CONTAINS(log, "0.444     Total estimated model params size (MB)");

  SUBCASE("max_depth = 0 disables the summary") {
    CHECK(make_callback("model_summary", {{"max_depth", integer(0)}})->hooks() == 0);
  }
  SUBCASE("nothing on other ranks") {
    trainer.cluster_info.global_rank = 1;
    CHECK(capture_log([&] { cb->on_fit_start(trainer); }).empty());
  }
}
