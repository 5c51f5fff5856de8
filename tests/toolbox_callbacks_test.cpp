// The training-technique callbacks (issue #18): ema, swa, backbone_finetuning, freeze_schedule,
// spike_detection and prediction_writer, each created from its built library through the registry
// (the testing kit's create_plugin), driven by the FakeTrainer or a real Trainer, plus the shipped
// fashion_mnist program run from a TOML file in its own process.
#include "test_support.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/testing.h>
#include <fulgur/testing/plugin_kit.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace kit = fulgur::testing;
using fulgur::OptionValue;
using fulgur::PluginKind;
using fulgur::test::contains;
using fulgur::test::run_command;
using fulgur::test::TempDir;
namespace fs = std::filesystem;
using Overrides = std::vector<std::pair<std::string, OptionValue>>;

std::shared_ptr<fulgur::Callback> make(const std::string& name, const Overrides& overrides = {}) {
  return kit::create_plugin<fulgur::Callback>(PluginKind::callback, name, overrides);
}

fulgur::ConfigBuilder quiet_options(const std::string& root, int64_t max_epochs) {
  return fulgur::ConfigBuilder()
      .set("default_root_dir", root)
      .set("max_epochs", max_epochs)
      .set("enable_progress_bar", false)
      .set("enable_model_summary", false)
      .set("enable_checkpointing", false)
      .set("num_sanity_val_steps", int64_t{0});
}

std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].equal(b[i])) return false;
  return true;
}

bool close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].allclose(b[i], 1e-6, 1e-7)) return false;
  return true;
}

void set_all(torch::nn::Module& m, double value) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.fill_(value);
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

// ---- ema ------------------------------------------------------------------------------------------

TEST_CASE("ema: the average is the hand-computed EMA, validation runs on it, checkpoints carry it") {
  kit::FakeTrainer trainer;
  torch::manual_seed(0);
  auto ema = make("ema", {{"decay", 0.75}});
  trainer.start_fit(*ema);
  auto& model = *trainer.module;
  fulgur::Batch batch;
  fulgur::StepOutput output;

  // Hand-made "training": the weights after step s are raw_s; ema_1 = raw_1, ema_s = 0.75 ema + 0.25 raw.
  std::vector<at::Tensor> expected;
  for (int s = 1; s <= 4; ++s) {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model.parameters()) p.add_(torch::randn_like(p));
    }
    trainer.step = s;
    ema->on_train_batch_end(trainer, output, batch, s - 1);
    const auto raw = snapshot(model);
    if (expected.empty()) {
      expected = raw;
    } else {
      for (size_t i = 0; i < raw.size(); ++i) expected[i] = 0.75 * expected[i] + 0.25 * raw[i];
    }
  }
  // A batch without an optimizer step (accumulation) does not update.
  ema->on_train_batch_end(trainer, output, batch, 4);

  const auto raw = snapshot(model);
  CHECK_FALSE(close(raw, expected));
  ema->on_validation_start(trainer);
  CHECK(close(snapshot(model), expected));
  ema->on_validation_end(trainer);
  CHECK(same(snapshot(model), raw));

  // The sanity check runs on the raw weights.
  trainer.sanity = true;
  ema->on_validation_start(trainer);
  CHECK(same(snapshot(model), raw));
  ema->on_validation_end(trainer);
  trainer.sanity = false;

  // State round trip: a new callback restores the average (a resumed run).
  c10::IValue state;
  ema->state_dict(state);
  CHECK(ema->state_key() == "EMAWeightAveraging");
  REQUIRE(state.isGenericDict());
  CHECK(state.toGenericDict().at("n_averaged").toInt() == 4);
  auto resumed = make("ema", {{"decay", 0.75}});
  resumed->load_state_dict(state);
  resumed->on_fit_start(trainer);
  resumed->on_test_start(trainer);
  CHECK(close(snapshot(model), expected));
  resumed->on_test_end(trainer);
  CHECK(same(snapshot(model), raw));

  // At the end of training the average replaces the weights (unless told otherwise).
  auto keep = make("ema", {{"decay", 0.75}, {"copy_average_at_end", false}});
  keep->load_state_dict(state);
  keep->on_fit_start(trainer);
  keep->on_train_end(trainer);
  CHECK(same(snapshot(model), raw));
  ema->on_train_end(trainer);
  CHECK(close(snapshot(model), expected));
}

TEST_CASE("ema: update_every_n_steps, update_starting_at_step and use_buffers change what is averaged") {
  kit::FakeTrainer trainer;
  auto ema =
      make("ema", {{"decay", 0.5}, {"update_every_n_steps", int64_t{2}}, {"update_starting_at_step", int64_t{2}}});
  trainer.start_fit(*ema);
  fulgur::Batch batch;
  fulgur::StepOutput output;
  // Steps 1..6 (step_idx 0..5) set every weight to the step index: updates at step_idx 2 and 4,
  // so the average is 0.5 * 2 + 0.5 * 4 = 3.
  for (int s = 1; s <= 6; ++s) {
    set_all(*trainer.module, s - 1);
    trainer.step = s;
    ema->on_train_batch_end(trainer, output, batch, s - 1);
  }
  ema->on_validation_start(trainer);
  for (const auto& p : trainer.module->parameters()) CHECK(p.detach().eq(3.0).all().item<bool>());
  ema->on_validation_end(trainer);

  // use_buffers: BatchNorm's running statistics are averaged (and swapped) too, or left alone.
  for (bool use_buffers : {true, false}) {
    kit::FakeTrainer bn_trainer;
    auto bn = torch::nn::BatchNorm1d(3);
    bn_trainer.module = torch::nn::Sequential(torch::nn::Linear(4, 3), bn).ptr();
    auto cb = make("ema", {{"decay", 0.5}, {"use_buffers", use_buffers}});
    bn_trainer.start_fit(*cb);
    for (int s = 1; s <= 2; ++s) {
      torch::NoGradGuard no_grad;
      bn->running_mean.fill_(static_cast<double>(s));  // 1, then 2: the EMA is 1.5
      bn_trainer.step = s;
      cb->on_train_batch_end(bn_trainer, output, batch, s - 1);
    }
    cb->on_validation_start(bn_trainer);
    CHECK(bn->running_mean.eq(use_buffers ? 1.5 : 2.0).all().item<bool>());
    cb->on_validation_end(bn_trainer);
    CHECK(bn->running_mean.eq(2.0).all().item<bool>());
  }

  CHECK_THROWS_WITH_AS(make("ema", {{"decay", 1.5}}), doctest::Contains("decay = 1.5"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("ema", {{"update_every_n_steps", int64_t{0}}}), doctest::Contains("update_every_n_steps"),
                       fulgur::Error);
  CHECK_THROWS_WITH_AS(make("ema", {{"device", std::string("gpu7")}}), doctest::Contains("device"), fulgur::Error);
}

// ---- swa ------------------------------------------------------------------------------------------

TEST_CASE("swa: the model ends as the mean of the weights captured each SWA epoch, the lr anneals (SWALR)") {
  kit::FakeTrainer trainer;
  trainer.max_epochs_value = 4;
  auto sgd = std::make_shared<torch::optim::SGD>(trainer.module->parameters(), torch::optim::SGDOptions(1.0));
  trainer.optimizer_list = {sgd.get()};
  // swa_epoch_start = 2 (1-based) -> SWA epochs 1, 2, 3 (0-based); linear annealing over 2 epochs.
  auto swa = make("swa", {{"swa_lrs", std::vector<double>{0.1}},
                          {"swa_epoch_start", int64_t{2}},
                          {"annealing_epochs", int64_t{2}},
                          {"annealing_strategy", std::string("linear")}});
  trainer.start_fit(*swa);
  std::vector<double> lrs;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    trainer.epoch = epoch;
    swa->on_train_epoch_start(trainer);
    swa->on_before_optimizer_step(trainer, *sgd);
    lrs.push_back(sgd->param_groups()[0].options().get_lr());
    set_all(*trainer.module, static_cast<double>(epoch + 1));  // the epoch's trained weights
    swa->on_train_epoch_end(trainer);
  }
  CHECK(lrs[0] == doctest::Approx(1.0));
  CHECK(lrs[1] == doctest::Approx(1.0));              // SWALR starts from the current lr
  CHECK(lrs[2] == doctest::Approx(0.5 * 0.1 + 0.5));  // half way
  CHECK(lrs[3] == doctest::Approx(0.1));              // annealed
  swa->on_train_end(trainer);
  // Captured: 2, 3, 4 -> mean 3 (not the last weights, 4).
  for (const auto& p : trainer.module->parameters()) CHECK(p.detach().eq(3.0).all().item<bool>());

  c10::IValue state;
  swa->state_dict(state);
  CHECK(state.toGenericDict().at("n_averaged").toInt() == 3);

  // cos annealing and a fractional start: 0.5 * 4 epochs -> 1-based epoch 2 -> SWA from epoch 1.
  kit::FakeTrainer cos_trainer;
  cos_trainer.max_epochs_value = 4;
  auto sgd2 = std::make_shared<torch::optim::SGD>(cos_trainer.module->parameters(), torch::optim::SGDOptions(1.0));
  cos_trainer.optimizer_list = {sgd2.get()};
  auto cos =
      make("swa", {{"swa_lrs", std::vector<double>{0.1}}, {"swa_epoch_start", 0.5}, {"annealing_epochs", int64_t{4}}});
  cos_trainer.start_fit(*cos);
  cos_trainer.epoch = 2;  // one epoch into SWA: t = 1/4, alpha = (1 - cos(pi/4)) / 2
  cos->on_train_epoch_start(cos_trainer);
  const double alpha = (1.0 - std::cos(M_PI / 4)) / 2.0;
  CHECK(sgd2->param_groups()[0].options().get_lr() == doctest::Approx(0.1 * alpha + 1.0 * (1 - alpha)));
}

TEST_CASE("swa: models with BatchNorm statistics and unusable settings are refused with a reason") {
  kit::FakeTrainer trainer;
  trainer.module = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3)).ptr();
  auto sgd = std::make_shared<torch::optim::SGD>(trainer.module->parameters(), torch::optim::SGDOptions(1.0));
  trainer.optimizer_list = {sgd.get()};
  auto swa = make("swa", {{"swa_lrs", std::vector<double>{0.1}}});
  CHECK_THROWS_WITH_AS(swa->on_fit_start(trainer), doctest::Contains("running statistics"), fulgur::Error);

  kit::FakeTrainer late;
  late.max_epochs_value = 3;
  late.optimizer_list = {sgd.get()};
  auto too_late = make("swa", {{"swa_lrs", std::vector<double>{0.1}}, {"swa_epoch_start", int64_t{9}}});
  CHECK_THROWS_WITH_AS(too_late->on_fit_start(late), doctest::Contains("nothing would be averaged"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("swa", {{"swa_lrs", std::vector<double>{0.1}}, {"annealing_strategy", std::string("exp")}}),
                       doctest::Contains("annealing_strategy"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("swa", {{"swa_lrs", std::vector<double>{0.1}}, {"swa_epoch_start", 1.5}}),
                       doctest::Contains("fraction"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("swa", {{"swa_lrs", std::vector<double>{}}}), doctest::Contains("swa_lrs"), fulgur::Error);
}

// ---- backbone_finetuning / freeze_schedule --------------------------------------------------------

namespace {

struct TwoPart : fulgur::Module {
  explicit TwoPart(bool only_trainable = false) : only_trainable(only_trainable) {
    backbone = register_module("backbone", torch::nn::Linear(32, 8));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    return {head->forward(torch::tanh(backbone->forward(batch.input))).pow(2).mean()};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    std::vector<at::Tensor> params;
    for (const auto& p : parameters())
      if (!only_trainable || p.requires_grad()) params.push_back(p);
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1)))};
  }
  bool only_trainable;
  torch::nn::Linear backbone{nullptr}, head{nullptr};
};

// At each epoch end: the weights and the first optimizer's groups (count, last group's lr).
struct EpochRecorder : fulgur::CallbackBase<EpochRecorder> {
  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    std::map<std::string, at::Tensor> weights;
    for (const auto& item : trainer.model().named_parameters()) weights[item.key()] = item.value().detach().clone();
    snapshots.push_back(weights);
    auto& groups = trainer.optimizers().front()->param_groups();
    group_counts.push_back(groups.size());
    last_lrs.push_back(groups.back().options().get_lr());
  }
  std::vector<std::map<std::string, at::Tensor>> snapshots;
  std::vector<size_t> group_counts;
  std::vector<double> last_lrs;
};

}  // namespace

TEST_CASE("backbone_finetuning: the backbone is frozen, then trained in its own group whose lr grows and aligns") {
  TempDir dir;
  torch::manual_seed(0);
  fulgur::Trainer trainer(quiet_options(dir.path().string(), 4));
  trainer.add_callback(
      make("backbone_finetuning",
           {{"unfreeze_backbone_at_epoch", int64_t{1}}, {"lambda_func", 4.0}, {"backbone_initial_ratio_lr", 0.1}}),
      "finetuning");
  auto recorder = std::make_shared<EpochRecorder>();
  trainer.add_callback(recorder, "recorder");
  TwoPart module;
  const at::Tensor backbone_before = module.backbone->weight.detach().clone();
  const at::Tensor head_before = module.head->weight.detach().clone();
  kit::BoringData data;
  trainer.fit(module, data);

  REQUIRE(recorder->snapshots.size() == 4);
  // Epoch 0: frozen backbone, the head trains; its group is the only one.
  CHECK(recorder->snapshots[0]["backbone.weight"].equal(backbone_before));
  CHECK_FALSE(recorder->snapshots[0]["head.weight"].equal(head_before));
  CHECK(recorder->group_counts[0] == 1);
  // Epoch 1: unfrozen as a second group at 0.1 x 0.1; it trains.
  CHECK(recorder->group_counts[1] == 2);
  CHECK(recorder->last_lrs[1] == doctest::Approx(0.01));
  CHECK_FALSE(recorder->snapshots[1]["backbone.weight"].equal(backbone_before));
  // Then x4 per epoch, capped at the head's lr (should_align).
  CHECK(recorder->last_lrs[2] == doctest::Approx(0.04));
  CHECK(recorder->last_lrs[3] == doctest::Approx(0.1));
  CHECK_FALSE(recorder->snapshots[3]["backbone.weight"].equal(recorder->snapshots[2]["backbone.weight"]));

  CHECK_THROWS_WITH_AS(
      [&] {
        fulgur::Trainer t(quiet_options(dir.path().string(), 1));
        t.add_callback(make("backbone_finetuning", {{"backbone", std::string("encoder")}}), "finetuning");
        TwoPart m;
        t.fit(m, data);
      }(),
      doctest::Contains("\"backbone\", \"head\""), fulgur::Error);
}

TEST_CASE(
    "backbone_finetuning: a run resumed after the unfreeze gets its backbone group back before the optimizer state") {
  TempDir dir;
  torch::manual_seed(0);
  kit::BoringData data;
  const Overrides finetuning{{"unfreeze_backbone_at_epoch", int64_t{1}}, {"lambda_func", 4.0}};
  const Overrides checkpointing{
      {"dirpath", (dir.path() / "ckpt").string()}, {"save_top_k", int64_t{0}}, {"save_last", true}};
  {
    fulgur::Trainer trainer(quiet_options(dir.path().string(), 2));
    trainer.add_callback(make("backbone_finetuning", finetuning), "finetuning");
    trainer.add_callback(make("model_checkpoint", checkpointing), "checkpoint");
    TwoPart module;
    trainer.fit(module, data);
  }
  REQUIRE(fs::exists(dir.path() / "ckpt" / "last.ckpt"));
  fulgur::Trainer trainer(quiet_options(dir.path().string(), 3));
  trainer.add_callback(make("backbone_finetuning", finetuning), "finetuning");
  auto recorder = std::make_shared<EpochRecorder>();
  trainer.add_callback(recorder, "recorder");
  TwoPart module;
  trainer.fit(module, data, (dir.path() / "ckpt" / "last.ckpt").string());
  REQUIRE(recorder->snapshots.size() == 1);  // epoch 2 only
  CHECK(recorder->group_counts[0] == 2);
  CHECK(recorder->last_lrs[0] == doctest::Approx(0.04));  // 0.01 at epoch 1, x4 at epoch 2
}

TEST_CASE(
    "freeze_schedule: parameters freeze and unfreeze at their epochs, unfrozen ones the optimizer lacks join it") {
  TempDir dir;
  torch::manual_seed(0);
  fulgur::Trainer trainer(quiet_options(dir.path().string(), 3));
  trainer.add_callback(
      make("freeze_schedule", {{"schedule", std::vector<std::string>{"1:freeze:head.b*", "2:unfreeze:backbone.*"}}}),
      "schedule");
  auto recorder = std::make_shared<EpochRecorder>();
  trainer.add_callback(recorder, "recorder");
  // The Module froze its backbone itself and built its optimizer from the trainable parameters.
  TwoPart module(/*only_trainable=*/true);
  for (auto& p : module.backbone->parameters()) p.set_requires_grad(false);
  const at::Tensor backbone_before = module.backbone->weight.detach().clone();
  kit::BoringData data;
  trainer.fit(module, data);

  REQUIRE(recorder->snapshots.size() == 3);
  auto& s = recorder->snapshots;
  CHECK(s[1]["backbone.weight"].equal(backbone_before));
  CHECK(s[2]["head.bias"].equal(s[0]["head.bias"]));            // frozen from epoch 1
  CHECK_FALSE(s[2]["head.weight"].equal(s[0]["head.weight"]));  // still training
  CHECK(recorder->group_counts[1] == 1);
  CHECK(recorder->group_counts[2] == 2);                        // the backbone joined the optimizer...
  CHECK_FALSE(s[2]["backbone.weight"].equal(backbone_before));  // ...and trained

  kit::FakeTrainer ddp;
  ddp.cluster_info.world_size = 2;
  for (const char* name : {"freeze_schedule", "backbone_finetuning"}) {
    auto cb = std::string(name) == "freeze_schedule"
                  ? make(name, {{"schedule", std::vector<std::string>{"0:freeze:*"}}})
                  : make(name);
    CHECK_THROWS_WITH_AS(cb->on_fit_start(ddp), doctest::Contains("several processes"), fulgur::Error);
  }
  CHECK_THROWS_WITH_AS(make("freeze_schedule", {{"schedule", std::vector<std::string>{"one:freeze:x"}}}),
                       doctest::Contains("EPOCH:freeze:PATTERN"), fulgur::Error);
  CHECK_THROWS_WITH_AS(
      [&] {
        fulgur::Trainer t(quiet_options(dir.path().string(), 1));
        t.add_callback(make("freeze_schedule", {{"schedule", std::vector<std::string>{"0:freeze:encoder.*"}}}), "s");
        TwoPart m;
        t.fit(m, data);
      }(),
      doctest::Contains("matches no parameter"), fulgur::Error);
}

// ---- gradient_accumulation_scheduler -------------------------------------------------------------

namespace {

// The global step and the accumulation factor at each training epoch's start.
struct AccumulationRecorder : fulgur::CallbackBase<AccumulationRecorder> {
  void on_train_epoch_start(fulgur::TrainerContext& t) override {
    steps.push_back(t.global_step());
    factors.push_back(t.accumulate_grad_batches());
  }
  void on_fit_end(fulgur::TrainerContext& t) override { after_fit = t.accumulate_grad_batches(); }
  std::vector<int64_t> steps, factors;
  int64_t after_fit = 0;
};

}  // namespace

TEST_CASE("gradient_accumulation_scheduler: the factor follows the epoch, also after a resume, and is restored") {
  TempDir dir;
  const Overrides scheduling = {{"scheduling", std::vector<std::string>{"1:2", "2:4"}}};
  const fs::path ckpt = dir.path() / "two_epochs.ckpt";
  {
    torch::manual_seed(0);
    fulgur::Trainer trainer(quiet_options(dir.path().string(), 4));
    trainer.add_callback(make("gradient_accumulation_scheduler", scheduling), "scheduler");
    auto recorder = std::make_shared<AccumulationRecorder>();
    trainer.add_callback(recorder, "recorder");
    kit::BoringModule module;
    kit::BoringData data;  // 8 batches per epoch
    trainer.fit(module, data);
    CHECK(recorder->factors == std::vector<int64_t>{1, 2, 4, 4});
    CHECK(recorder->steps == std::vector<int64_t>{0, 8, 12, 14});
    CHECK(trainer.global_step() == 16);
    CHECK(recorder->after_fit == 1);  // the scheduler's callbacks ran before the recorder's
  }
  {
    // Two epochs, saved; a new Trainer resumes for the third: its factor is that of epoch 2.
    torch::manual_seed(0);
    fulgur::Trainer first(quiet_options(dir.path().string(), 2));
    first.add_callback(make("gradient_accumulation_scheduler", scheduling), "scheduler");
    kit::BoringModule module;
    kit::BoringData data;
    first.fit(module, data);
    first.save_checkpoint(ckpt.string());
    fulgur::Trainer second(quiet_options(dir.path().string(), 3));
    second.add_callback(make("gradient_accumulation_scheduler", scheduling), "scheduler");
    kit::BoringModule resumed;
    second.fit(resumed, data, ckpt.string());
    CHECK(second.global_step() == 14);
  }
  CHECK_THROWS_WITH_AS(make("gradient_accumulation_scheduler", {{"scheduling", std::vector<std::string>{"2"}}}),
                       doctest::Contains("is not EPOCH:FACTOR"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("gradient_accumulation_scheduler", {{"scheduling", std::vector<std::string>{"1:0"}}}),
                       doctest::Contains("FACTOR >= 1"), fulgur::Error);
  CHECK_THROWS_WITH_AS(
      make("gradient_accumulation_scheduler", {{"scheduling", std::vector<std::string>{"1:2", "1:4"}}}),
      doctest::Contains("epoch 1 appears twice"), fulgur::Error);
  kit::FakeTrainer fake;
  fake.accumulate = 2;
  CHECK_THROWS_WITH_AS(make("gradient_accumulation_scheduler", scheduling)->on_fit_start(fake),
                       doctest::Contains("leave accumulate_grad_batches at 1"), fulgur::Error);
}

TEST_CASE("gradient_accumulation_scheduler from TOML in the example: 8 + 4 + 2 optimizer steps in 3 epochs") {
  TempDir dir;
  const fs::path ckpt = dir.path() / "ckpt";
  const std::string toml =
      "[trainer]\nmax_epochs = 3\nseed = 7\nlimit_train_batches = 8\nlimit_val_batches = 2\n"
      "limit_test_batches = 2\nenable_progress_bar = false\ndefault_root_dir = \"" +
      (dir.path() / "runs").string() +
      "\"\n[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\n"
      "[[callbacks]]\nname = \"gradient_accumulation_scheduler\"\nscheduling = [\"1:2\", \"2:4\"]\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" +
      ckpt.string() + "\"\nsave_top_k = 0\nsave_last = true\n";
  fulgur::test::write_bytes(dir.path() / "job.toml", toml);
  const auto run = fulgur::test::run_process(
      {FULGUR_TEST_FASHION_MNIST, "--config", (dir.path() / "job.toml").string()}, {}, dir.path());
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const auto checkpoint = fulgur::read_checkpoint_file((ckpt / "last.ckpt").string()).toGenericDict();
  CHECK(checkpoint.at("global_step").toInt() == 14);
}

// ---- spike_detection ------------------------------------------------------------------------------

namespace {

// Lightning's BoringModel with SGD + momentum; batch 5 of epoch 0 has a loss 10^4 times the others.
struct SpikyModule : kit::BoringModule {
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t batch_idx) override {
    const double scale = batch_idx == 5 && !spiked ? 100.0 : 1.0;
    if (scale > 1.0) spiked = true;
    return {layer->forward(batch.input * scale).pow(2).mean()};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)))};
  }
  bool spiked = false;
};

// Which batches changed the weights.
struct StepWatcher : fulgur::CallbackBase<StepWatcher> {
  void on_train_batch_start(fulgur::TrainerContext& trainer, const fulgur::Batch&, int64_t) override {
    before = snapshot(trainer.model());
  }
  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    changed.push_back(!same(before, snapshot(trainer.model())));
  }
  std::vector<at::Tensor> before;
  std::vector<bool> changed;
};

}  // namespace

TEST_CASE("spike_detection: skip leaves the weights untouched at the spike step, warn goes on, raise stops") {
  TempDir dir;
  torch::manual_seed(0);
  kit::BoringData data;
  {
    fulgur::Trainer trainer(quiet_options(dir.path().string(), 1));
    trainer.add_callback(make("spike_detection", {{"action", std::string("skip")}}), "spikes");
    auto watcher = std::make_shared<StepWatcher>();
    trainer.add_callback(watcher, "watcher");
    SpikyModule module;
    trainer.fit(module, data);
    REQUIRE(watcher->changed.size() == 8);
    for (size_t b = 0; b < 8; ++b) {
      INFO("batch " << b);
      CHECK(watcher->changed[b] == (b != 5));  // momentum moves the weights at every other step
    }
    CHECK(contains(read_text(dir.path() / "skip_batches.json"), "5"));
  }
  {
    fulgur::Trainer trainer(quiet_options(dir.path().string(), 1));
    trainer.add_callback(make("spike_detection", {{"action", std::string("warn")},
                                                  {"exclude_batches_path", (dir.path() / "warn").string()}}),
                         "spikes");
    auto watcher = std::make_shared<StepWatcher>();
    trainer.add_callback(watcher, "watcher");
    SpikyModule module;
    trainer.fit(module, data);
    REQUIRE(watcher->changed.size() == 8);
    CHECK(watcher->changed[5]);
    // The applied spike wrecked the weights, so later batches spike too: Lightning's list format.
    CHECK(read_text(dir.path() / "warn" / "skip_batches.json").rfind("[\n    5,\n    6", 0) == 0);
  }
  {
    fulgur::Trainer trainer(quiet_options(dir.path().string(), 1));
    trainer.add_callback(make("spike_detection"), "spikes");  // action = "raise" by default
    SpikyModule module;
    CHECK_THROWS_WITH_AS(trainer.fit(module, data), doctest::Contains("loss spike at epoch 0, batch 5"), fulgur::Error);
  }
  CHECK_THROWS_WITH_AS(make("spike_detection", {{"action", std::string("ignore")}}), doctest::Contains("action"),
                       fulgur::Error);
}

// ---- prediction_writer ----------------------------------------------------------------------------

TEST_CASE("prediction_writer: per-batch and per-epoch files per rank, .pt opens in Python, csv has a row per sample") {
  TempDir dir;
  torch::manual_seed(0);
  kit::BoringData data;
  kit::BoringModule module;
  const fs::path out = dir.path() / "preds";
  fulgur::Trainer trainer(quiet_options(dir.path().string(), 1));
  trainer.add_callback(
      make("prediction_writer", {{"write_interval", std::string("batch_and_epoch")}, {"output_dir", out.string()}}),
      "writer");
  const std::vector<at::Tensor> predictions = trainer.predict(module, data);
  REQUIRE(predictions.size() == 8);

  const auto epoch = fulgur::read_checkpoint_file((out / "predictions_rank0.pt").string()).toGenericDict();
  const auto list = epoch.at("predictions").toList();
  REQUIRE(list.size() == 8);
  for (size_t b = 0; b < 8; ++b) CHECK(list.get(b).toTensor().equal(predictions[b]));
  const auto batch3 = fulgur::read_checkpoint_file((out / "predictions_rank0_batch3.pt").string()).toGenericDict();
  CHECK(batch3.at("prediction").toTensor().equal(predictions[3]));
  CHECK(batch3.at("batch_idx").toInt() == 3);

  const std::string script = fmt::format(
      "import torch; d = torch.load('{}', weights_only=True); b = torch.load('{}', weights_only=True); "
      "print(len(d['predictions']), tuple(d['predictions'][0].shape), d['batch_indices'][-1], b['batch_idx'])",
      (out / "predictions_rank0.pt").string(), (out / "predictions_rank0_batch7.pt").string());
  const auto [status, output] = run_command(fmt::format("{} -c \"{}\"", FULGUR_TEST_PYTHON, script));
  INFO(output);
  CHECK(status == 0);
  CHECK(contains(output, "8 (8, 2) 7 7"));

  fulgur::Trainer csv_trainer(quiet_options(dir.path().string(), 1));
  csv_trainer.add_callback(
      make("prediction_writer", {{"write_interval", std::string("epoch")}, {"format", std::string("csv")}}), "writer");
  csv_trainer.predict(module, data);
  const std::string csv = read_text(dir.path() / "predictions" / "predictions_rank0.csv");
  CHECK(csv.rfind("batch_idx,sample,v0,v1\n", 0) == 0);
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 1 + 64);
  CHECK(contains(csv,
                 fmt::format("\n0,0,{},{}\n", predictions[0][0][0].item<float>(), predictions[0][0][1].item<float>())));
  CHECK_FALSE(fs::exists(dir.path() / "predictions" / "predictions_rank0_batch0.csv"));

  CHECK_THROWS_WITH_AS(make("prediction_writer", {{"format", std::string("npy")}}), doctest::Contains("format"),
                       fulgur::Error);
}

// ---- model_pruning --------------------------------------------------------------------------------

TEST_CASE("model_pruning: L1 pruning reaches the set sparsity on the smallest weights, logs it, and zeros stay zero") {
  kit::FakeTrainer trainer;
  auto first = torch::nn::Linear(4, 4);
  auto second = torch::nn::Linear(4, 4);
  trainer.module = torch::nn::Sequential(first, second).ptr();
  {
    // 32 weights with distinct magnitudes 1..32, alternating signs; the biases are not selected.
    torch::NoGradGuard no_grad;
    const at::Tensor values = torch::arange(1, 33, torch::kFloat) * torch::tensor({1.0f, -1.0f}).repeat(16);
    first->weight.copy_(values.slice(0, 0, 16).view({4, 4}));
    second->weight.copy_(values.slice(0, 16, 32).view({4, 4}));
  }
  auto pruning = make("model_pruning", {{"amount", 0.5}, {"end_epoch", int64_t{1}}, {"verbose", int64_t{2}}});
  trainer.start_fit(*pruning);
  auto zeros = [&] { return (first->weight == 0).sum().item<int64_t>() + (second->weight == 0).sum().item<int64_t>(); };
  auto all_weights = [&] {
    return torch::cat({first->weight.detach().reshape(-1), second->weight.detach().reshape(-1)});
  };

  pruning->on_train_epoch_end(trainer);  // epoch 0: half of 32
  CHECK(zeros() == 16);
  // The 16 smallest magnitudes (1..16: all of the first layer) went.
  CHECK(first->weight.eq(0).all().item<bool>());
  REQUIRE(trainer.logged.size() == 1);
  CHECK(trainer.logged[0].metrics.at("pruning/sparsity") == doctest::Approx(0.5));
  CHECK(trainer.logged[0].metrics.at("pruning/sparsity/0.weight") == doctest::Approx(1.0));

  // An optimizer step moves every weight; the pruned ones are put back to zero.
  {
    torch::NoGradGuard no_grad;
    first->weight.add_(1.0);
    second->weight.add_(1.0);
  }
  fulgur::Batch batch;
  pruning->on_train_batch_end(trainer, fulgur::StepOutput{}, batch, 0);
  CHECK(zeros() == 16);

  trainer.epoch = 1;
  pruning->on_train_epoch_end(trainer);  // half of the 16 left
  CHECK(zeros() == 24);
  CHECK(trainer.logged.back().metrics.at("pruning/sparsity") == doctest::Approx(0.75));
  const at::Tensor survivors = all_weights().abs().masked_select(all_weights() != 0);
  CHECK(survivors.min().item<float>() >= 25.0f - 1.0f);  // the largest magnitudes remain (shifted by the +1 step)

  trainer.epoch = 2;  // past end_epoch: no more pruning
  pruning->on_train_epoch_end(trainer);
  CHECK(zeros() == 24);
  CHECK(trainer.logged.size() == 2);

  // The masks survive a checkpoint.
  c10::IValue state;
  pruning->state_dict(state);
  auto resumed = make("model_pruning", {{"amount", 0.5}});
  resumed->load_state_dict(state);
  {
    torch::NoGradGuard no_grad;
    first->weight.fill_(3.0);
    second->weight.fill_(3.0);
  }
  resumed->on_fit_start(trainer);
  CHECK(zeros() == 24);

  CHECK_THROWS_WITH_AS(make("model_pruning", {{"pruning_fn", std::string("ln_structured")}}),
                       doctest::Contains("pruning_fn"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("model_pruning", {{"amount", 1.5}}), doctest::Contains("amount"), fulgur::Error);
}

TEST_CASE("model_pruning: a real fit ends with the scheduled sparsity in the weights") {
  TempDir dir;
  torch::manual_seed(0);
  fulgur::Trainer trainer(quiet_options(dir.path().string(), 3));
  trainer.add_callback(make("model_pruning", {{"amount", 0.5}, {"start_epoch", int64_t{1}}}), "pruning");
  kit::BoringModule module;
  kit::BoringData data;
  trainer.fit(module, data);
  // Epochs 1 and 2 prune: 64 -> 32 -> 16 left; the bias is untouched.
  CHECK((module.layer->weight == 0).sum().item<int64_t>() == 48);
  CHECK((module.layer->bias == 0).sum().item<int64_t>() == 0);
}

TEST_CASE("model_pruning: ln_structured zeroes whole rows (or columns) of smallest norm, cumulatively") {
  kit::FakeTrainer trainer;
  auto layer = torch::nn::Linear(torch::nn::LinearOptions(3, 6));
  trainer.module = torch::nn::Sequential(layer).ptr();
  // Row r has L2 norm proportional to kRowScale[r]; the three smallest are rows 4, 1 and 5.
  const std::vector<float> kRowScale = {6, 2, 4, 5, 1, 3};
  {
    torch::NoGradGuard no_grad;
    for (int64_t r = 0; r < 6; ++r) layer->weight[r].fill_(kRowScale[static_cast<size_t>(r)]);
    layer->weight.mul_(torch::tensor({1.0f, -1.0f, 1.0f}));  // signs do not change a norm
  }
  auto pruning = make("model_pruning", {{"pruning_fn", std::string("ln_structured")},
                                        {"pruning_norm", 2.0},
                                        {"pruning_dim", int64_t{0}},
                                        {"use_global_unstructured", false},
                                        {"amount", 0.5}});
  trainer.start_fit(*pruning);
  auto zero_rows = [&] {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < 6; ++r)
      if (layer->weight[r].eq(0).all().item<bool>()) rows.push_back(r);
    return rows;
  };
  pruning->on_train_epoch_end(trainer);
  CHECK(zero_rows() == std::vector<int64_t>{1, 4, 5});
  CHECK((layer->weight == 0).sum().item<int64_t>() == 9);  // whole rows, nothing else
  CHECK((layer->bias == 0).sum().item<int64_t>() == 0);
  CHECK(trainer.logged.back().metrics.at("pruning/sparsity") == doctest::Approx(0.5));

  {  // a step moves every weight; the pruned rows go back to zero
    torch::NoGradGuard no_grad;
    layer->weight.add_(0.5);
  }
  fulgur::Batch batch;
  pruning->on_train_batch_end(trainer, fulgur::StepOutput{}, batch, 0);
  CHECK(zero_rows() == std::vector<int64_t>{1, 4, 5});

  trainer.epoch = 1;  // round(0.5 * 3 surviving rows) = 2 more: those of scale 4 and 5 (6 stays)
  pruning->on_train_epoch_end(trainer);
  CHECK(zero_rows() == std::vector<int64_t>{1, 2, 3, 4, 5});
  CHECK(trainer.logged.back().metrics.at("pruning/sparsity") == doctest::Approx(5.0 / 6.0));

  // pruning_dim = 1: whole columns (the input features) go; here column 2 has the smallest L1 norm.
  kit::FakeTrainer columns_trainer;
  auto other = torch::nn::Linear(torch::nn::LinearOptions(4, 2).bias(false));
  columns_trainer.module = torch::nn::Sequential(other).ptr();
  {
    torch::NoGradGuard no_grad;
    other->weight.copy_(torch::tensor({{3.0f, -4.0f, 0.5f, 2.0f}, {3.0f, 4.0f, -0.5f, -2.0f}}));
  }
  auto by_column = make("model_pruning", {{"pruning_fn", std::string("ln_structured")},
                                          {"pruning_norm", 1.0},
                                          {"pruning_dim", int64_t{1}},
                                          {"use_global_unstructured", false},
                                          {"amount", 0.25}});
  columns_trainer.start_fit(*by_column);
  by_column->on_train_epoch_end(columns_trainer);
  CHECK(other->weight.eq(0).sum(0).equal(torch::tensor({0, 0, 2, 0}, torch::kLong)));

  // Settings that cannot work are refused with the key to change.
  using O = Overrides;
  CHECK_THROWS_WITH_AS(make("model_pruning", O{{"pruning_fn", std::string("ln_structured")}, {"pruning_norm", 2.0}}),
                       doctest::Contains("use_global_unstructured = false"), fulgur::Error);
  CHECK_THROWS_WITH_AS(
      make("model_pruning", O{{"pruning_fn", std::string("ln_structured")}, {"use_global_unstructured", false}}),
      doctest::Contains("needs pruning_norm"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("model_pruning", O{{"pruning_norm", 2.0}}),
                       doctest::Contains("pruning_norm applies to pruning_fn = \"ln_structured\" only"), fulgur::Error);
  CHECK_THROWS_WITH_AS(make("model_pruning", O{{"pruning_dim", int64_t{1}}}),
                       doctest::Contains("pruning_dim applies to"), fulgur::Error);
  auto too_deep = make("model_pruning", {{"pruning_fn", std::string("ln_structured")},
                                         {"pruning_norm", 2.0},
                                         {"pruning_dim", int64_t{2}},
                                         {"use_global_unstructured", false}});
  CHECK_THROWS_WITH_AS(too_deep->on_fit_start(columns_trainer), doctest::Contains("pruning_dim = 2 does not exist"),
                       fulgur::Error);
}

TEST_CASE("model_pruning ln_structured from TOML in the example: whole rows zeroed, the fraction reached and logged") {
  TempDir dir;
  const fs::path ckpt = dir.path() / "ckpt";
  const std::string toml =
      "[trainer]\nmax_epochs = 3\nseed = 7\nlimit_train_batches = 4\nlimit_val_batches = 2\n"
      "limit_test_batches = 2\nlog_every_n_steps = 1\nenable_progress_bar = false\ndefault_root_dir = \"" +
      (dir.path() / "runs").string() +
      "\"\n[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\n"
      "[[callbacks]]\nname = \"model_pruning\"\npruning_fn = \"ln_structured\"\npruning_norm = 2\n"
      "pruning_dim = 0\nuse_global_unstructured = false\namount = 0.5\nend_epoch = 1\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" +
      ckpt.string() + "\"\nsave_top_k = 0\nsave_last = true\n";
  fulgur::test::write_bytes(dir.path() / "job.toml", toml);
  const auto run = fulgur::test::run_process(
      {FULGUR_TEST_FASHION_MNIST, "--config", (dir.path() / "job.toml").string()}, {}, dir.path());
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const auto weights =
      fulgur::read_checkpoint_file((ckpt / "last.ckpt").string()).toGenericDict().at("state_dict").toGenericDict();
  // fc1 [256, 784]: 128 rows after epoch 0, 64 more after epoch 1; fc2 [10, 256]: 5, then
  // round(2.5) = 2 (half to even, as torch counts). last.ckpt is written at the end of epoch 2's
  // validation (before that epoch's on_train_epoch_end, as in Lightning), after a whole epoch of
  // training on the pruned weights.
  auto zero_rows = [&](const char* name) {
    const at::Tensor w = weights.at(name).toTensor();
    return w.eq(0).all(1).sum().item<int64_t>();
  };
  auto zeros = [&](const char* name) { return weights.at(name).toTensor().eq(0).sum().item<int64_t>(); };
  CHECK(zero_rows("fc1.weight") == 192);
  CHECK(zeros("fc1.weight") == 192 * 784);  // whole rows only
  CHECK(zero_rows("fc2.weight") == 7);
  CHECK(zeros("fc2.weight") == 7 * 256);
  CHECK(zeros("fc1.bias") < 256);
  // The sparsity of the last pruning reached the loggers.
  const double expected = (192.0 * 784 + 7 * 256) / (256.0 * 784 + 10 * 256);
  std::string csv;
  for (const auto& entry : fs::recursive_directory_iterator(dir.path() / "runs"))
    if (entry.path().filename() == "metrics.csv") csv = read_text(entry.path());
  REQUIRE(contains(csv, "pruning/sparsity"));
  CHECK(contains(csv, fmt::format("{}", expected).substr(0, 8)));
}

// ---- the shipped program --------------------------------------------------------------------------

TEST_CASE("fashion_mnist with ema, swa and spike_detection from TOML: checkpoints carry both averages") {
  TempDir dir;
  const fs::path ckpt = dir.path() / "ckpt";
  const std::string toml =
      "[trainer]\nmax_epochs = 2\nseed = 7\nlimit_train_batches = 10\nlimit_val_batches = 2\n"
      "limit_test_batches = 2\nlog_every_n_steps = 5\nenable_progress_bar = false\ndefault_root_dir = \"" +
      (dir.path() / "runs").string() +
      "\"\n[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\n"
      "[[callbacks]]\nname = \"ema\"\ndecay = 0.9\n"
      "[[callbacks]]\nname = \"swa\"\nswa_lrs = [0.0005]\nswa_epoch_start = 1\nannealing_epochs = 1\n"
      "[[callbacks]]\nname = \"spike_detection\"\naction = \"warn\"\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" +
      ckpt.string() + "\"\nsave_top_k = 0\nsave_last = true\n";
  fulgur::test::write_bytes(dir.path() / "job.toml", toml);
  const auto run =
      fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", (dir.path() / "job.toml").string()},
                                {{"FULGUR_LOG_LEVEL", "info"}}, dir.path());
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(contains(run.output, "the model now holds the average of the weights of 2 epoch(s)"));

  const auto checkpoint = fulgur::read_checkpoint_file((ckpt / "last.ckpt").string()).toGenericDict();
  const auto callbacks = checkpoint.at("callbacks").toGenericDict();
  const auto weights = checkpoint.at("state_dict").toGenericDict();
  const auto ema = callbacks.at("EMAWeightAveraging").toGenericDict();
  CHECK(ema.at("n_averaged").toInt() == 20);  // every optimizer step of 2 epochs x 10 batches
  const auto ema_avg = ema.at("average").toGenericDict();
  REQUIRE(ema_avg.size() == weights.size());
  const at::Tensor raw = weights.at("fc1.weight").toTensor();
  CHECK(ema_avg.at("fc1.weight").toTensor().sizes() == raw.sizes());
  CHECK_FALSE(ema_avg.at("fc1.weight").toTensor().equal(raw));
  const auto swa = callbacks.at("StochasticWeightAveraging").toGenericDict();
  CHECK(swa.at("n_averaged").toInt() == 2);
  CHECK_FALSE(swa.at("average").toGenericDict().at("fc1.weight").toTensor().equal(raw));
}
