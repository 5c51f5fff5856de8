// How the Trainer steps learning-rate schedulers (Lightning's _update_learning_rates): per step or
// per epoch, every `frequency` batches of the epoch (batch_idx + 1) or epochs, only at optimizer
// steps under gradient accumulation, reduce-on-plateau on a monitored metric against
// torch.optim.lr_scheduler.ReduceLROnPlateau, and a resume in the middle of the schedule.
#include <fulgur/callback.h>
#include <fulgur/checkpoint_io.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/lr_scheduler.h>
#include <fulgur/lr_schedulers.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <functional>
#include <sstream>

#include "save_at_step.h"
#include "test_support.h"

namespace {

using fulgur::SchedulerInterval;
using fulgur::test::contains;
using fulgur::test::TempDir;

// One linear layer on 40 samples in batches of 8: 5 batches per epoch, a count no frequency
// below divides, so per-epoch and global counting differ.
struct ScheduledModule : fulgur::Module {
  using Attach = std::function<fulgur::OptimizerConfig(std::shared_ptr<torch::optim::SGD>)>;
  explicit ScheduledModule(Attach attach) : attach(std::move(attach)) {
    fc = register_module("fc", torch::nn::Linear(8, 3));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    lrs.push_back(sgd->param_groups()[0].options().get_lr());
    return {torch::nn::functional::cross_entropy(fc->forward(b.input), b.target)};
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t) override {
    const at::Tensor loss = torch::nn::functional::cross_entropy(fc->forward(b.input), b.target);
    log("val/loss", loss);
    val_sum += loss.item<double>();
    ++val_batches;
    return {};
  }
  void on_validation_epoch_end() override {
    val_losses.push_back(val_sum / static_cast<double>(val_batches));
    val_sum = 0;
    val_batches = 0;
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    sgd = std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1));
    return {attach(sgd)};
  }
  Attach attach;
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<torch::optim::SGD> sgd;
  std::vector<double> lrs, val_losses;
  double val_sum = 0;
  int64_t val_batches = 0;
};

struct Data : fulgur::DataModule {
  Data() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
    x = at::randn({40, 8}, gen);
    y = (x.slice(1, 0, 1).squeeze(1) > 0).to(at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(8));
  }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(8));
  }
  at::Tensor x, y;
};

using fulgur::test::SaveAtStep;

fulgur::Config config(const TempDir& dir, const std::string& keys) {
  return fulgur::parse_config(
      fmt::format("[trainer]\ndefault_root_dir = \"{}\"\nseed = 3\nenable_progress_bar = false\n"
                  "enable_model_summary = false\nenable_checkpointing = false\nlogger = false\n"
                  "num_sanity_val_steps = 0\n{}\n",
                  dir.path().string(), keys),
      dir / "test.toml");
}

ScheduledModule::Attach step_lr(SchedulerInterval interval, int64_t frequency, std::string monitor = {}) {
  return [=](std::shared_ptr<torch::optim::SGD> sgd) {
    return fulgur::OptimizerConfig(sgd).with_scheduler(fulgur::make_step_lr(*sgd, 1, 0.5), interval, frequency,
                                                       monitor);
  };
}

std::vector<double> powers(const std::vector<int>& exponents) {
  std::vector<double> out;
  for (int e : exponents) out.push_back(0.1 * std::pow(0.5, e));
  return out;
}

void check_lrs(const std::vector<double>& actual, const std::vector<double>& expected) {
  INFO("lrs seen by training_step: " << fmt::format("{}", actual));
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size(); ++i) CHECK(actual[i] == doctest::Approx(expected[i]).epsilon(1e-12));
}

}  // namespace

TEST_CASE("#37 schedulers step per step or per epoch, every `frequency` batches of the epoch, as Lightning's") {
  struct Case {
    std::string name, keys;
    ScheduledModule::Attach attach;
    std::vector<int> halvings;  // StepLR(1, 0.5) steps taken before each training_step
  };
  const std::vector<Case> cases = {
      // Lightning: after the batches with (batch_idx + 1) % 2 == 0, i.e. 1 and 3 of every epoch.
      {"step, frequency 2", "max_epochs = 2", step_lr(SchedulerInterval::step, 2), {0, 0, 1, 1, 2, 2, 2, 3, 3, 4}},
      {"step, frequency 1", "max_epochs = 2", step_lr(SchedulerInterval::step, 1), {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}},
      {"epoch, frequency 1", "max_epochs = 2", step_lr(SchedulerInterval::epoch, 1), {0, 0, 0, 0, 0, 1, 1, 1, 1, 1}},
      {"epoch, frequency 2",
       "max_epochs = 3",
       step_lr(SchedulerInterval::epoch, 2),
       {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1}},
      // Accumulating 2: optimizer steps after batches 1, 3 and the last (4) of each epoch.
      {"step, accumulate 2",
       "max_epochs = 2\naccumulate_grad_batches = 2",
       step_lr(SchedulerInterval::step, 1),
       {0, 0, 1, 1, 2, 3, 3, 4, 4, 5}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    TempDir dir;
    fulgur::Trainer trainer(config(dir, c.keys));
    ScheduledModule module(c.attach);
    Data data;
    trainer.fit(module, data);
    check_lrs(module.lrs, powers(c.halvings));
  }
}

TEST_CASE("#37 reduce-on-plateau steps on the monitored metric as torch's ReduceLROnPlateau") {
  TempDir dir;
  fulgur::Trainer trainer(config(dir, "max_epochs = 5"));
  // mode max on a falling loss: no epoch improves, so the lr halves after every `patience` + 1.
  ScheduledModule module([](std::shared_ptr<torch::optim::SGD> sgd) {
    return fulgur::OptimizerConfig(sgd).with_scheduler(fulgur::make_reduce_on_plateau(*sgd, true, 0.5, 1),
                                                       SchedulerInterval::epoch, 1, "val/loss");
  });
  Data data;
  trainer.fit(module, data);
  REQUIRE(module.val_losses.size() == 5);
  const std::string script = fmt::format(R"(
import torch
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
s = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=1)
out = []
for metric in {}:
    out.append(opt.param_groups[0]["lr"])
    s.step(metric)
print("lrs", " ".join(repr(v) for v in out))
)",
                                         fmt::format("[{}]", fmt::join(module.val_losses, ", ")));
  std::ofstream(dir / "plateau.py") << script;
  const auto [status, output] =
      fulgur::test::run_command(fmt::format("{} {} 2>&1", FULGUR_TEST_PYTHON, (dir / "plateau.py").string()));
  INFO(output);
  REQUIRE(status == 0);
  std::istringstream words(output.substr(output.find("lrs ") + 4));
  std::vector<double> per_epoch;
  for (double v; words >> v;) per_epoch.push_back(v);
  REQUIRE(per_epoch.size() == 5);
  std::vector<double> expected;
  for (double lr : per_epoch)
    for (int b = 0; b < 5; ++b) expected.push_back(lr);
  check_lrs(module.lrs, expected);
  CHECK(per_epoch.back() < 0.1);  // it did reduce
}

namespace {
// What `run` logs through spdlog's default logger, message text only.
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

// A step schedule (it halves the lr at every step it takes, metric or not) that monitors a metric
// nobody logs, with Lightning's `name` and `strict`.
ScheduledModule::Attach unlogged_monitor(bool strict) {
  return [=](std::shared_ptr<torch::optim::SGD> sgd) {
    return fulgur::OptimizerConfig(sgd).with_scheduler(
        fulgur::with_scheduler_keys(*sgd, fulgur::make_step_lr(*sgd, 1, 0.5), {.name = "plateau", .strict = strict}),
        SchedulerInterval::epoch, 1, "val/missing");
  };
}
}  // namespace

TEST_CASE("#37 scheduler strict: a monitor never logged stops the run when strict, else warns and skips the step") {
  TempDir dir;
  Data data;
  {
    // Lightning's default, strict: an error that names the scheduler, the metric and the way out.
    fulgur::Trainer trainer(config(dir, "max_epochs = 2"));
    ScheduledModule module(unlogged_monitor(true));
    try {
      trainer.fit(module, data);
      FAIL("fit did not stop on the missing monitor");
    } catch (const fulgur::Error& e) {
      const std::string what = e.what();
      CHECK_MESSAGE(contains(what, "the lr scheduler 'plateau' monitors 'val/missing', which was never logged"), what);
      CHECK_MESSAGE(contains(what, "Logged metrics: "), what);
      CHECK_MESSAGE(contains(what, "val/loss"), what);
      CHECK_MESSAGE(contains(what, "strict = false"), what);
    }
  }
  {
    // strict = false: a warning, and the schedule does not move (each step it took would halve the lr).
    fulgur::Trainer trainer(config(dir, "max_epochs = 3"));
    ScheduledModule module(unlogged_monitor(false));
    const std::string log = capture_log([&] { trainer.fit(module, data); });
    CHECK_MESSAGE(contains(log,
                           "the lr scheduler 'plateau' monitors 'val/missing', which is not available, but "
                           "strict is false: its learning rate is not updated this time"),
                  log);
    check_lrs(module.lrs, std::vector<double>(15, 0.1));
  }
}

TEST_CASE("#37 scheduler keys: a keyed scheduler steps, checkpoints and resumes as the one it wraps") {
  auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())},
                                                 torch::optim::SGDOptions(0.1));
  auto plain_sgd = std::make_shared<torch::optim::SGD>(
      std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())}, torch::optim::SGDOptions(0.1));
  auto keyed = fulgur::with_scheduler_keys(*sgd, fulgur::make_step_lr(*sgd, 2, 0.5), {.name = "decay"});
  auto plain = fulgur::make_step_lr(*plain_sgd, 2, 0.5);
  CHECK(fulgur::scheduler_keys(*keyed).name == "decay");
  CHECK(fulgur::scheduler_keys(*keyed).strict);
  CHECK(fulgur::scheduler_keys(*plain).name.empty());
  for (int i = 0; i < 5; ++i) {
    keyed->step();
    plain->step();
    CHECK(keyed->last_lr() == plain->last_lr());
    CHECK(keyed->step_count() == plain->step_count());
  }
  CHECK(keyed->state() == plain->state());
  auto fresh_sgd = std::make_shared<torch::optim::SGD>(
      std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())}, torch::optim::SGDOptions(0.1));
  auto restored = fulgur::make_step_lr(*fresh_sgd, 2, 0.5);
  restored->load_state(keyed->state());
  CHECK(restored->last_lr() == keyed->last_lr());
}

TEST_CASE("#37 a run resumed in the middle of a schedule sees the learning rates of the uninterrupted one") {
  TempDir dir;
  const auto attach = step_lr(SchedulerInterval::step, 2);
  ScheduledModule whole(attach);
  {
    fulgur::Trainer trainer(config(dir, "max_epochs = 2"));
    Data data;
    trainer.fit(whole, data);
  }
  const std::string ckpt = (dir / "mid.ckpt").string();
  {
    // Saved after batch 1 of epoch 1 (global step 7), between the scheduler steps of batches 1 and 3.
    fulgur::Trainer trainer(config(dir, "max_epochs = 2\nmax_steps = 7"));
    trainer.add_callback(std::make_shared<SaveAtStep>(7, ckpt), "save_at_step");
    ScheduledModule first(attach);
    Data data;
    trainer.fit(first, data);
  }
  fulgur::Trainer trainer(config(dir, "max_epochs = 2"));
  ScheduledModule second(attach);
  Data data;
  trainer.fit(second, data, ckpt);
  const std::vector<double> rest(whole.lrs.begin() + 7, whole.lrs.end());
  check_lrs(second.lrs, rest);
}

TEST_CASE("#37 lr_monitor logs a named scheduler's learning rate under its name, as Lightning's") {
  TempDir dir;
  const ScheduledModule::Attach named = [](std::shared_ptr<torch::optim::SGD> sgd) {
    return fulgur::OptimizerConfig(sgd).with_scheduler(
        fulgur::with_scheduler_keys(*sgd, fulgur::make_step_lr(*sgd, 1, 0.5), {.name = "decay"}),
        SchedulerInterval::step, 1);
  };
  fulgur::Trainer trainer(fulgur::parse_config(
      fmt::format("[trainer]\ndefault_root_dir = \"{}\"\nseed = 3\nenable_progress_bar = false\n"
                  "enable_model_summary = false\nenable_checkpointing = false\nnum_sanity_val_steps = 0\n"
                  "max_steps = 4\nlog_every_n_steps = 1\n[[loggers]]\nlogger = \"csv\"\n"
                  "flush_logs_every_n_steps = 1\n[[callbacks]]\nname = \"lr_monitor\"\n",
                  dir.path().string()),
      dir / "test.toml"));
  ScheduledModule module(named);
  Data data;
  trainer.fit(module, data);
  auto csv = fulgur::test::read_csv(dir / "lightning_logs" / "version_0" / "metrics.csv");
  CHECK_FALSE(csv.count("lr-SGD"));  // the class name is what an unnamed scheduler logs under
  REQUIRE(csv.count("decay"));
  std::vector<double> logged;
  for (const std::string& cell : csv["decay"])
    if (!cell.empty()) logged.push_back(std::stod(cell));
  // What the module saw at each step: the learning rate lr_monitor read before it.
  check_lrs(logged, module.lrs);
}
