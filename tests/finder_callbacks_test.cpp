// The tuning pieces of issue #18: the lr_finder callback (Lightning's LearningRateFinder) and
// Lightning's BatchSizeFinder. The arithmetic is tested on its own (the plugins' headers), then
// each plugin with the testing kit, inside a real fit and through the shipped fashion_mnist
// program from TOML; the batch-size search also against trials whose memory is counted.
#include "test_support.h"
#include "training_job.h"

#include "../plugins/callback/batch_size_finder/batch_size_search.h"
#include "../plugins/callback/batch_size_finder/trial_memory.h"
#include "../plugins/callback/lr_finder/lr_sweep.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/data.h>
#include <fulgur/testing/plugin_kit.h>

#include <doctest/doctest.h>
#include <png.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace kit = fulgur::testing;
namespace lf = fulgur::lr_finder;
using fulgur::OptionValue;
using fulgur::PluginKind;
using fulgur::test::contains;
using fulgur::test::TempDir;
namespace fs = std::filesystem;
using Overrides = std::vector<std::pair<std::string, OptionValue>>;

std::shared_ptr<fulgur::Callback> make(const std::string& name, const Overrides& overrides = {}) {
  return kit::create_plugin<fulgur::Callback>(PluginKind::callback, name, overrides);
}

// lr_find.csv as rows of {lr, loss, smoothed_loss, suggested}.
struct CsvRow {
  double lr, loss, smoothed;
  bool suggested;
};
std::vector<CsvRow> read_lr_csv(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  REQUIRE(line == "step,lr,loss,smoothed_loss,suggested");
  std::vector<CsvRow> rows;
  while (std::getline(in, line)) {
    int step = 0, suggested = 0;
    CsvRow row{};
    REQUIRE(std::sscanf(line.c_str(), "%d,%lf,%lf,%lf,%d", &step, &row.lr, &row.loss, &row.smoothed, &suggested) == 5);
    row.suggested = suggested == 1;
    rows.push_back(row);
  }
  return rows;
}

double suggested_lr(const std::vector<CsvRow>& rows) {
  for (const auto& r : rows)
    if (r.suggested) return r.lr;
  FAIL("no row of lr_find.csv is marked as the suggestion");
  return 0;
}

// Decodes a PNG with libpng: width, height, and whether it has pixels of the marker's red.
struct PngInfo {
  uint32_t width = 0, height = 0;
  bool has_marker_red = false;
  int distinct_colors = 0;
};
PngInfo decode_png(const fs::path& file) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  REQUIRE(png_image_begin_read_from_file(&image, file.c_str()) != 0);
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(image));
  REQUIRE(png_image_finish_read(&image, nullptr, pixels.data(), 0, nullptr) != 0);
  PngInfo info{image.width, image.height, false, 0};
  std::set<uint32_t> colors;
  for (size_t i = 0; i + 2 < pixels.size(); i += 3) {
    colors.insert(uint32_t{pixels[i]} << 16 | uint32_t{pixels[i + 1]} << 8 | pixels[i + 2]);
    if (pixels[i] == 210 && pixels[i + 1] == 30 && pixels[i + 2] == 30) info.has_marker_red = true;
  }
  info.distinct_colors = static_cast<int>(colors.size());
  return info;
}

// A one-weight linear regression, prediction w * x with every x = 1 and every target 3: the loss
// (w - 3)^2 has curvature 2, so plain gradient descent reaches the minimum in one step with
// lr = 1 / 2 (the optimum), and diverges above lr = 1.
struct Regression : fulgur::Module {
  Regression() { layer = register_module("layer", torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false))); }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    return {torch::mse_loss(layer->forward(batch.input).squeeze(1), batch.target)};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    sgd = std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.01));
    return {fulgur::OptimizerConfig(sgd)};
  }
  double weight() const { return layer->weight.item<double>(); }
  double lr() const { return sgd->param_groups()[0].options().get_lr(); }
  torch::nn::Linear layer{nullptr};
  std::shared_ptr<torch::optim::SGD> sgd;
};

struct RegressionData : fulgur::DataModule {
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(torch::ones({64, 1}), torch::full({64}, 3.0),
                                      fulgur::TensorLoaderOptions().batch_size(2));  // 32 batches
  }
};

fulgur::ConfigBuilder quiet(const fs::path& root) {
  return fulgur::ConfigBuilder()
      .set("default_root_dir", root.string())
      .set("max_epochs", int64_t{1})
      .set("enable_progress_bar", false)
      .set("enable_model_summary", false)
      .set("enable_checkpointing", false)
      .set("logger", false)
      .set("num_sanity_val_steps", int64_t{0});
}

}  // namespace

// ---- lr_finder -------------------------------------------------------------------------------------

TEST_CASE("lr_finder sweep: lrs span min_lr..max_lr, the loss is smoothed, divergence stops, steepest descent wins") {
  lf::LrSweep exponential(lf::LrSweepOptions().min_lr(1e-4).max_lr(1.0).num_training_steps(5));
  CHECK(exponential.lr_at(0) == doctest::Approx(1e-4));
  CHECK(exponential.lr_at(2) == doctest::Approx(1e-2));
  CHECK(exponential.lr_at(4) == doctest::Approx(1.0));
  lf::LrSweep linear(lf::LrSweepOptions().min_lr(0.1).max_lr(0.5).num_training_steps(5).mode(lf::SweepMode::linear));
  CHECK(linear.lr_at(1) == doctest::Approx(0.2));

  // Bias-corrected moving average: beta = 0.5, losses 4 then 2 -> 4, then (0.5*0.5*4 + 0.5*2) / 0.75 = 2.666...
  lf::LrSweep smooth(lf::LrSweepOptions().num_training_steps(10).beta(0.5));
  smooth.record(4.0);
  smooth.record(2.0);
  CHECK(smooth.points()[0].smoothed_loss == doctest::Approx(4.0));
  CHECK(smooth.points()[1].smoothed_loss == doctest::Approx(2.0 / 0.75));

  // Divergence: without smoothing, a loss above 4x the best one ends the sweep.
  lf::LrSweep diverging(lf::LrSweepOptions().num_training_steps(10).beta(0.0));
  CHECK_FALSE(diverging.record(1.0));
  CHECK_FALSE(diverging.record(0.5));
  CHECK_FALSE(diverging.record(1.9));
  CHECK(diverging.record(2.1));
  CHECK(diverging.diverged());
  lf::LrSweep patient(lf::LrSweepOptions().num_training_steps(10).beta(0.0).early_stop_threshold(std::nan("")));
  for (double loss : {1.0, 0.5, 50.0}) CHECK_FALSE(patient.record(loss));

  // A loss curve 1 - tanh(3 (log10 lr + 3)) falls fastest at lr = 1e-3: the suggestion is the
  // swept lr nearest to it, not the lowest loss (at the end) nor the first lrs.
  lf::LrSweep curve(lf::LrSweepOptions().min_lr(1e-6).max_lr(1.0).num_training_steps(61).beta(0.0).skip_begin(2));
  while (!curve.finished()) curve.record(1.0 - std::tanh(3.0 * (std::log10(curve.next_lr()) + 3.0)));
  REQUIRE(curve.suggestion());
  CHECK(*curve.suggestion() == doctest::Approx(1e-3).epsilon(1e-9));
  // Non-finite losses and the skipped ends are never suggested; too few points: no suggestion.
  lf::LrSweep few(lf::LrSweepOptions().num_training_steps(4).skip_begin(2).skip_end(1));
  for (double loss : {3.0, 2.0, 1.0, 0.5}) few.record(loss);
  CHECK_FALSE(few.suggestion());
}

TEST_CASE("lr_finder on a linear regression: the suggestion is within 2x of the optimal lr, weights are restored") {
  // The steepest descent of the loss is where one step removes the largest part of the loss left;
  // on this quadratic one step at lr removes 1 - (1 - 2 lr)^2 of it, most at the optimum 0.5.
  // Every step before also takes some loss away, so the steepest point comes at or a little
  // before the optimum; with 4 lrs per decade (21 steps over 1e-4..10) it lands at 0.316.
  TempDir dir;
  Regression module;
  RegressionData data;
  {
    torch::NoGradGuard no_grad;
    module.layer->weight.fill_(0.0);
  }
  fulgur::Trainer trainer(quiet(dir.path()));
  trainer.add_callback(
      make("lr_finder",
           {{"min_lr", 1e-4}, {"max_lr", 10.0}, {"num_training_steps", int64_t{21}}, {"stop_after_sweep", true}}),
      "lr_finder");
  trainer.fit(module, data);
  const auto rows = read_lr_csv(dir.path() / "lr_find.csv");
  CHECK(rows.size() <= 21);
  CHECK(rows.size() >= 18);  // it may stop a little early on the divergence above lr = 1
  const double suggestion = suggested_lr(rows);
  MESSAGE("suggested lr " << suggestion << " (optimum 0.5)");
  CHECK(suggestion >= 0.25);
  CHECK(suggestion <= 1.0);
  // Stopped right after the sweep: the weight is the one from before it, the lr the suggestion.
  CHECK(module.weight() == 0.0);
  CHECK(trainer.global_step() == static_cast<int64_t>(rows.size()));
  CHECK(module.lr() == doctest::Approx(suggestion));
  CHECK(fs::exists(dir.path() / "lr_find.png"));
}

TEST_CASE("lr_finder: training goes on from the restored weights with the suggested lr") {
  TempDir dir;
  Regression module;
  RegressionData data;
  {
    torch::NoGradGuard no_grad;
    module.layer->weight.fill_(0.0);
  }
  fulgur::Trainer trainer(quiet(dir.path()));
  trainer.add_callback(
      make("lr_finder",
           {{"min_lr", 1e-4}, {"max_lr", 0.3}, {"num_training_steps", int64_t{12}}, {"skip_begin", int64_t{2}}}),
      "lr_finder");
  trainer.fit(module, data);
  const auto rows = read_lr_csv(dir.path() / "lr_find.csv");
  REQUIRE(rows.size() == 12);  // no divergence below lr = 1
  const double lr = suggested_lr(rows);
  // 32 batches: 12 sweep steps, then 20 steps of lr from w = 0: w = 3 (1 - (1 - 2 lr)^20).
  CHECK(trainer.global_step() == 32);
  CHECK(module.weight() == doctest::Approx(3.0 * (1.0 - std::pow(1.0 - 2.0 * lr, 20))).epsilon(1e-4));

  // update_attr = false: the sweep still restores everything, the original lr stays.
  TempDir other;
  Regression untouched;
  {
    torch::NoGradGuard no_grad;
    untouched.layer->weight.fill_(0.0);
  }
  fulgur::Trainer again(quiet(other.path()));
  again.add_callback(make("lr_finder", {{"min_lr", 1e-4},
                                        {"max_lr", 0.3},
                                        {"num_training_steps", int64_t{12}},
                                        {"skip_begin", int64_t{2}},
                                        {"update_attr", false}}),
                     "lr_finder");
  again.fit(untouched, data);
  CHECK(untouched.weight() == doctest::Approx(3.0 * (1.0 - std::pow(1.0 - 2.0 * 0.01, 20))).epsilon(1e-4));
}

TEST_CASE("lr_finder: options that cannot work are refused with the key to change") {
  CHECK_THROWS_WITH_AS(make("lr_finder", {{"min_lr", 0.0}}), doctest::Contains("min_lr = 0 must be > 0"),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("lr_finder", {{"max_lr", 1e-9}}), doctest::Contains("must be greater than min_lr"),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("lr_finder", {{"mode", std::string("cosine")}}), doctest::Contains("\"exponential\""),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("lr_finder", {{"early_stop_threshold", 0.5}}), doctest::Contains("must be > 1"),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("lr_finder", {{"beta", 1.0}}), doctest::Contains("beta = 1 must lie in [0, 1)"),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("lr_finder", {{"num_training_steps", int64_t{10}}}),
                       doctest::Contains("fewer than 2 of num_training_steps = 10"), fulgur::Error);
}

TEST_CASE("lr_finder from TOML in the example: csv and png in the log dir, pre-sweep weights kept on stop") {
  TempDir dir;
  namespace job = fulgur::test::job;
  // Run 1: the sweep, then stop. Run 2: the same job (same seed, same initial weights) trained for
  // one batch with an lr too small to move a float32 weight (1e-30): its checkpoint holds the
  // initial weights.
  auto job_toml = [&](const std::string& name, int batches, const std::string& model_extra, const std::string& extra) {
    return "[trainer]\nmax_epochs = 1\nseed = 7\nlimit_train_batches = " + std::to_string(batches) +
           "\nlimit_val_batches = 2\nlimit_test_batches = 2\nenable_progress_bar = false\ndefault_root_dir = \"" +
           (dir.path() / name / "runs").string() + "\"\n[model]\narch = \"mlp\"\n" + model_extra +
           "[data]\nbatch_size = 32\n" + extra + job::checkpointing(dir.path() / name / "ckpt", 0);
  };
  fulgur::test::write_bytes(dir.path() / "sweep.toml",
                            job_toml("a", 25, "",
                                     "[[callbacks]]\nname = \"lr_finder\"\nmin_lr = 1e-5\nmax_lr = 1.0\n"
                                     "num_training_steps = 20\nskip_begin = 3\nstop_after_sweep = true\n"));
  fulgur::test::write_bytes(dir.path() / "initial.toml", job_toml("b", 1, "lr = 1e-30\n", ""));
  const auto sweep = job::run_example(dir.path() / "sweep.toml", dir.path());
  INFO(sweep.output);
  REQUIRE(sweep.exit_code == 0);
  CHECK(contains(sweep.output, "suggested lr"));

  fs::path csv, png;
  for (const auto& entry : fs::recursive_directory_iterator(dir.path() / "a" / "runs")) {
    if (entry.path().filename() == "lr_find.csv") csv = entry.path();
    if (entry.path().filename() == "lr_find.png") png = entry.path();
  }
  REQUIRE(!csv.empty());
  REQUIRE(!png.empty());
  CHECK(csv.parent_path() == png.parent_path());
  const auto rows = read_lr_csv(csv);
  CHECK(rows.size() >= 4);
  CHECK(rows.size() <= 20);
  CHECK(rows.front().lr == doctest::Approx(1e-5));
  const double suggestion = suggested_lr(rows);

  // The PNG: signature, IHDR size, and a decoded picture that is a plot (several colours, the
  // suggestion's red marker).
  {
    std::ifstream in(png, std::ios::binary);
    std::string head(24, '\0');
    in.read(head.data(), 24);
    CHECK(head.substr(0, 8) == std::string("\x89PNG\r\n\x1a\n", 8));
    CHECK(head.substr(12, 4) == "IHDR");
    auto be32 = [&](size_t at) {
      return uint32_t{static_cast<uint8_t>(head[at])} << 24 | uint32_t{static_cast<uint8_t>(head[at + 1])} << 16 |
             uint32_t{static_cast<uint8_t>(head[at + 2])} << 8 | uint32_t{static_cast<uint8_t>(head[at + 3])};
    };
    CHECK(be32(16) == 800);
    CHECK(be32(20) == 500);
  }
  const PngInfo picture = decode_png(png);
  CHECK(picture.width == 800);
  CHECK(picture.height == 500);
  CHECK(picture.has_marker_red);
  CHECK(picture.distinct_colors >= 5);

  // Stopped after the sweep: the checkpoint's weights are the initial ones; the optimizer (Adam)
  // has no state left from the sweep, and its lr is the suggestion.
  const auto initial = job::run_example(dir.path() / "initial.toml", dir.path());
  INFO(initial.output);
  REQUIRE(initial.exit_code == 0);
  CHECK(job::same_weights(dir.path() / "a" / "ckpt" / "last.ckpt", dir.path() / "b" / "ckpt" / "last.ckpt"));
  const auto checkpoint = job::checkpoint_dict(dir.path() / "a" / "ckpt" / "last.ckpt");
  CHECK(checkpoint.at("global_step").toInt() == static_cast<int64_t>(rows.size()));
  const auto optimizer = checkpoint.at("optimizer_states").toList().get(0).toGenericDict();
  CHECK(optimizer.at("state").toGenericDict().size() == 0);
  const auto groups = optimizer.at("param_groups").toList();
  CHECK(groups.get(0).toGenericDict().at("lr").toDouble() == doctest::Approx(suggestion));
  const auto finder_state = checkpoint.at("callbacks").toGenericDict().at("LearningRateFinder").toGenericDict();
  CHECK(finder_state.at("done").toBool());
}

// ---- batch size search ----------------------------------------------------------------------------

namespace {

namespace bsf = fulgur::batch_size_finder;

// Runs the search against `fits(size)`; returns the result and the sizes tried, in order.
std::pair<std::optional<int64_t>, std::vector<int64_t>> search(bsf::BatchSizeSearchOptions options,
                                                               const std::function<bool(int64_t)>& fits) {
  bsf::BatchSizeSearch s(options);
  std::vector<int64_t> tried;
  while (!s.done()) {
    tried.push_back(s.next());
    s.report(fits(s.next()));
  }
  return {s.result(), tried};
}

// steps_per_trial SGD steps (with momentum, whose buffers the first step allocates) of a small MLP
// on a batch of `batch_size` random samples: what a training trial at that size allocates, weights
// and data included.
void mlp_trial(int64_t batch_size, int64_t steps_per_trial) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(256, 512), torch::nn::ReLU(), torch::nn::Linear(512, 10));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const at::Tensor x = torch::randn({batch_size, 256});
  const at::Tensor y = torch::randint(0, 10, {batch_size}, torch::kLong);
  for (int64_t step = 0; step < steps_per_trial; ++step) {
    sgd.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    sgd.step();
  }
}

int64_t trial_peak(int64_t batch_size) {
  const auto outcome = bsf::run_trial([&] { mlp_trial(batch_size, 3); }, std::numeric_limits<int64_t>::max());
  REQUIRE(outcome.peak_bytes);
  return *outcome.peak_bytes;
}

}  // namespace

TEST_CASE("batch size search: power doubles to the last size that fits, binsearch bisects, limits hold") {
  auto up_to_100 = [](int64_t size) { return size <= 100; };
  auto power = search(bsf::BatchSizeSearchOptions(), up_to_100);
  CHECK(power.first == 64);
  CHECK(power.second == std::vector<int64_t>{2, 4, 8, 16, 32, 64, 128});
  auto bisect = search(bsf::BatchSizeSearchOptions().mode(bsf::SearchMode::binsearch), up_to_100);
  CHECK(bisect.first == 100);
  CHECK(bisect.second == std::vector<int64_t>{2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101});
  // A first size too large: power halves until one fits and stops there (twice it failed).
  auto from_above = search(bsf::BatchSizeSearchOptions().init_val(256), up_to_100);
  CHECK(from_above.first == 64);
  CHECK(from_above.second == std::vector<int64_t>{256, 128, 64});
  CHECK(search(bsf::BatchSizeSearchOptions().init_val(256).mode(bsf::SearchMode::binsearch), up_to_100).first == 100);
  // max_trials ends the search with the last size that fit; max_val (the dataset) caps it.
  CHECK(search(bsf::BatchSizeSearchOptions().max_trials(3), up_to_100).first == 8);
  auto capped = search(bsf::BatchSizeSearchOptions().max_val(50), up_to_100);
  CHECK(capped.first == 50);
  CHECK(capped.second.back() == 50);
  // Nothing fits: no result.
  CHECK_FALSE(search(bsf::BatchSizeSearchOptions(), [](int64_t) { return false; }).first);
  CHECK_THROWS_AS(bsf::BatchSizeSearch(bsf::BatchSizeSearchOptions().init_val(0)), std::invalid_argument);

  // A trial that runs out of device memory (c10::OutOfMemoryError, what CUDA's caching allocator
  // throws) does not fit; any other error is not taken for one.
  auto device_trial = [](int64_t size) {
    const auto outcome =
        bsf::run_trial([&] { TORCH_CHECK_WITH(OutOfMemoryError, size <= 100, "CUDA out of memory (simulated)"); }, 0);
    CHECK(outcome.out_of_memory == (size > 100));
    CHECK_FALSE(outcome.peak_bytes);
    return outcome.fits;
  };
  CHECK(search(bsf::BatchSizeSearchOptions(), device_trial).first == 64);
  CHECK_THROWS_AS(bsf::run_trial([] { throw std::runtime_error("a bug in the step"); }, 0), std::runtime_error);
}

TEST_CASE("batch size search against a CPU memory budget: the largest power of two whose trial fits") {
  // The budget: 4 MiB of tensor memory for 3 SGD steps of the MLP (weights, momentum, activations,
  // gradients and the batch itself).
  constexpr int64_t kBudget = 4 << 20;
  const int64_t small = trial_peak(16), large = trial_peak(1024);
  MESSAGE("peak tensor memory of a trial: batch 16: " << small << " B, batch 1024: " << large << " B");
  REQUIRE(large > small);  // the measurement sees the batch
  // The counter is exact: a second trial of the same size counts the same bytes.
  CHECK(trial_peak(16) == small);

  std::vector<std::pair<int64_t, int64_t>> measured;  // (size, peak) of every trial run
  auto fits = [&](int64_t size) {
    const auto outcome = bsf::run_trial([&] { mlp_trial(size, 3); }, kBudget);
    REQUIRE(outcome.peak_bytes);
    measured.emplace_back(size, *outcome.peak_bytes);
    return outcome.fits;
  };
  const auto power = search(bsf::BatchSizeSearchOptions().init_val(2), fits);
  REQUIRE(power.first);
  const int64_t found = *power.first;
  MESSAGE("power mode: batch size " << found << " (peak " << trial_peak(found)
                                    << " B; twice it: " << trial_peak(2 * found) << " B; budget " << kBudget << " B)");
  CHECK((found & (found - 1)) == 0);
  CHECK(trial_peak(found) <= kBudget);
  CHECK(trial_peak(2 * found) > kBudget);
  CHECK(found >= 64);  // the budget is far above the weights alone: the search went up

  const auto bisect = search(bsf::BatchSizeSearchOptions().mode(bsf::SearchMode::binsearch), fits);
  REQUIRE(bisect.first);
  MESSAGE("binsearch mode: batch size " << *bisect.first);
  CHECK(*bisect.first >= found);
  CHECK(*bisect.first < 2 * found);
  CHECK(trial_peak(*bisect.first) <= kBudget);
  CHECK(trial_peak(*bisect.first + 1) > kBudget);
}

// ---- batch_size_finder -------------------------------------------------------------------------------

namespace {

// batch_size_finder.csv as (batch_size, fits, out_of_memory, peak_bytes) rows.
struct TrialRow {
  int64_t batch_size;
  bool fits, out_of_memory;
  int64_t peak_bytes, batches_run;
};
std::vector<TrialRow> read_trials(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  REQUIRE(line == "trial,batch_size,fits,out_of_memory,peak_bytes,batches_run");
  std::vector<TrialRow> rows;
  while (std::getline(in, line)) {
    long long trial = 0, size = 0, peak = 0, run = 0;
    int fits = 0, oom = 0;
    REQUIRE(std::sscanf(line.c_str(), "%lld,%lld,%d,%d,%lld,%lld", &trial, &size, &fits, &oom, &peak, &run) == 6);
    rows.push_back({size, fits == 1, oom == 1, peak, run});
  }
  return rows;
}

std::vector<int64_t> sizes_of(const std::vector<TrialRow>& rows) {
  std::vector<int64_t> sizes;
  for (const auto& r : rows) sizes.push_back(r.batch_size);
  return sizes;
}

}  // namespace

TEST_CASE("batch_size_finder with the testing kit: the largest size without out-of-memory, trials on disk") {
  TempDir dir;
  const c10::Device cuda(c10::DeviceType::CUDA, 0);  // the callback only asks; the kit runs nothing there
  auto fresh = [&](std::optional<int64_t> limit) {
    auto trainer = std::make_unique<kit::FakeTrainer>(dir.path().string());
    trainer->device_value = cuda;
    trainer->batch_size = 32;
    trainer->trial_size_limit = limit;
    return trainer;
  };
  {
    auto trainer = fresh(100);
    auto finder = make("batch_size_finder");
    trainer->start_fit(*finder);
    CHECK(trainer->trials == std::vector<int64_t>{2, 4, 8, 16, 32, 64, 128});
    CHECK(trainer->batch_size == 64);
    const auto rows = read_trials(dir.path() / "batch_size_finder.csv");
    CHECK(sizes_of(rows) == trainer->trials);
    CHECK(rows.back().out_of_memory);
    CHECK_FALSE(rows.back().fits);
    CHECK(rows[5].fits);
    CHECK(rows[5].peak_bytes == -1);  // on cuda the error decides; nothing is counted
    REQUIRE(trainer->logged.size() == 1);
    CHECK(trainer->logged[0].metrics.at("batch_size_finder/batch_size") == 64.0);

    // The result goes into checkpoints; a resumed fit takes it without a new search.
    c10::IValue state;
    finder->state_dict(state);
    auto resumed_trainer = fresh(100);
    auto resumed = make("batch_size_finder");
    resumed->load_state_dict(state);
    resumed_trainer->start_fit(*resumed);
    CHECK(resumed_trainer->trials.empty());
    CHECK(resumed_trainer->batch_size == 64);
  }
  {
    auto trainer = fresh(100);
    auto finder = make("batch_size_finder", {{"mode", std::string("binsearch")}, {"init_val", int64_t{16}}});
    trainer->start_fit(*finder);
    CHECK(trainer->trials == std::vector<int64_t>{16, 32, 64, 128, 96, 112, 104, 100, 102, 101});
    CHECK(trainer->batch_size == 100);
  }
  {
    // max_trials ends the search with the last size that fit.
    auto trainer = fresh(100);
    auto finder = make("batch_size_finder", {{"max_trials", int64_t{3}}});
    trainer->start_fit(*finder);
    CHECK(trainer->trials == std::vector<int64_t>{2, 4, 8});
    CHECK(trainer->batch_size == 8);
  }
  {
    // A size whose one batch holds the whole training set (40 samples) ends the search.
    auto trainer = fresh(std::nullopt);
    trainer->train_samples = 40;
    auto finder = make("batch_size_finder", {{"init_val", int64_t{8}}});
    trainer->start_fit(*finder);
    CHECK(trainer->trials == std::vector<int64_t>{8, 16, 32, 64});
    CHECK(trainer->batch_size == 64);
  }
  {
    // Nothing fits: the run stops with the smallest size tried and what to change.
    auto trainer = fresh(0);
    auto finder = make("batch_size_finder", {{"init_val", int64_t{4}}});
    CHECK_THROWS_WITH_AS(trainer->start_fit(*finder),
                         doctest::Contains("no batch size fits, down to 1 (out of memory)"), fulgur::Error);
    CHECK(trainer->trials == std::vector<int64_t>{4, 2, 1});
    CHECK(trainer->batch_size == 32);
  }
}

TEST_CASE("batch_size_finder: what cannot work is refused with what to change") {
  TempDir dir;
  CHECK_THROWS_WITH_AS(make("batch_size_finder", {{"mode", std::string("linear")}}), doctest::Contains("\"binsearch\""),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("batch_size_finder", {{"steps_per_trial", int64_t{0}}}),
                       doctest::Contains("steps_per_trial = 0 must be >= 1"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("batch_size_finder", {{"max_memory_mb", -1.0}}), doctest::Contains("max_memory_mb = -1"),
                       fulgur::Error);
  kit::FakeTrainer cpu(dir.path().string());
  cpu.batch_size = 32;
  // On cpu running out of memory is no exception: a budget is required.
  CHECK_THROWS_WITH_AS(cpu.start_fit(*make("batch_size_finder")), doctest::Contains("set max_memory_mb"),
                       fulgur::Error);
  kit::FakeTrainer cuda(dir.path().string());
  cuda.batch_size = 32;
  cuda.device_value = c10::Device(c10::DeviceType::CUDA, 0);
  CHECK_THROWS_WITH_AS(cuda.start_fit(*make("batch_size_finder", {{"max_memory_mb", 100.0}})),
                       doctest::Contains("set max_memory_mb = 0"), fulgur::Error);
  kit::FakeTrainer no_handle(dir.path().string());  // batch_size = -1: the DataModule offers none
  CHECK_THROWS_WITH_AS(no_handle.start_fit(*make("batch_size_finder", {{"max_memory_mb", 100.0}})),
                       doctest::Contains("DataModule::batch_size() and set_batch_size(n)"), fulgur::Error);
  CHECK(cpu.trials.empty());
}

TEST_CASE("batch_size_finder from TOML in the example: trials within the budget, then training as if at that size") {
  TempDir dir;
  namespace job = fulgur::test::job;
  auto job_toml = [&](const std::string& name, int64_t batch_size, const std::string& extra, int epochs = 1,
                      const std::string& trainer_extra = "") {
    return "[trainer]\nmax_epochs = " + std::to_string(epochs) +
           "\nseed = 7\nlimit_train_batches = 3\nlimit_val_batches = 2\nenable_progress_bar = false\n"
           "default_root_dir = \"" +
           (dir.path() / name / "runs").string() + "\"\n" + trainer_extra +
           "[model]\narch = \"mlp\"\n[data]\nbatch_size = " + std::to_string(batch_size) + "\nnum_workers = 1\n" +
           extra + job::checkpointing(dir.path() / name / "ckpt", 0);
  };
  const std::string finder =
      "[[callbacks]]\nname = \"batch_size_finder\"\nmax_memory_mb = 8\nsteps_per_trial = 2\ninit_val = 16\n";
  fulgur::test::write_bytes(dir.path() / "find.toml", job_toml("a", 32, finder));
  const auto found_run = job::run_example(dir.path() / "find.toml", dir.path());
  INFO(found_run.output);
  REQUIRE(found_run.exit_code == 0);

  fs::path csv;
  for (const auto& entry : fs::recursive_directory_iterator(dir.path() / "a" / "runs"))
    if (entry.path().filename() == "batch_size_finder.csv") csv = entry.path();
  REQUIRE(!csv.empty());
  const auto rows = read_trials(csv);
  REQUIRE(rows.size() >= 2);
  // Power mode from 16: every size that fit was within 8 MiB, the first that did not was above.
  constexpr int64_t kBudget = 8 << 20;
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    CHECK(rows[i].fits);
    CHECK(rows[i].peak_bytes <= kBudget);
    CHECK(rows[i].batches_run == 2);
    CHECK(rows[i + 1].batch_size == 2 * rows[i].batch_size);
  }
  CHECK_FALSE(rows.back().fits);
  CHECK(rows.back().peak_bytes > kBudget);
  CHECK(rows.back().peak_bytes > rows.front().peak_bytes);
  const int64_t found = rows[rows.size() - 2].batch_size;
  CHECK(contains(found_run.output, "training with batch size " + std::to_string(found) + " (configured 32"));
  const auto checkpoint = job::checkpoint_dict(dir.path() / "a" / "ckpt" / "last.ckpt");
  CHECK(checkpoint.at("callbacks")
            .toGenericDict()
            .at("BatchSizeFinder")
            .toGenericDict()
            .at("optimal_batch_size")
            .toInt() == found);

  // The trials left nothing behind: the same job at that batch size without the finder ends with
  // the same weights, bit for bit (weights, Adam's state, the random state and the loaders were
  // all restored).
  fulgur::test::write_bytes(dir.path() / "plain.toml", job_toml("b", found, ""));
  const auto plain = job::run_example(dir.path() / "plain.toml", dir.path());
  INFO(plain.output);
  REQUIRE(plain.exit_code == 0);
  CHECK(job::same_weights(dir.path() / "a" / "ckpt" / "last.ckpt", dir.path() / "b" / "ckpt" / "last.ckpt"));

  // Resumed for a second epoch: the size comes from the checkpoint, no trial runs again.
  const fs::path last = dir.path() / "a" / "ckpt" / "last.ckpt";
  fulgur::test::write_bytes(dir.path() / "resume.toml",
                            job_toml("a", 32, finder, 2, "ckpt_path = \"" + last.string() + "\"\n"));
  const auto resumed = job::run_example(dir.path() / "resume.toml", dir.path());
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.output, "batch size " + std::to_string(found) + " from the checkpoint (no new search)"));
  CHECK_FALSE(contains(resumed.output, "does not fit"));
  CHECK(job::checkpoint_dict(last).at("epoch").toInt() == 1);
}
