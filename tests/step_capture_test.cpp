// `[trainer] cuda_graphs` (issue #12, item 6) without a GPU: the capturable optimizer step against
// libtorch's own Adam and AdamW, and the shipped example driven from TOML through the whole
// capture flow (warm-up, capture, replays, logged values, refusals) with the fixture accelerator
// `fixture_replay_graph`, whose StepGraph replays by running the step again. The CUDA graph
// itself runs in the GPU suite (cuda_accelerator_test.cpp) and in scripts/gpu_check.sh.
#include "test_support.h"

#include <fulgur/checkpoint_io.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <doctest/doctest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <fstream>
#include <string>

#include "../core/src/capture/fused_adam_step.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;

// A Linear of the same shape and weights (drawing its own initial weights first).
torch::nn::Linear copy_of(const torch::nn::Linear& model) {
  torch::nn::Linear copy(model->options);
  copy->weight.detach().copy_(model->weight.detach());
  copy->bias.detach().copy_(model->bias.detach());
  return copy;
}

// Random gradients, the same in both layers.
void same_random_gradients(torch::nn::Linear& a, torch::nn::Linear& b) {
  for (auto [pa, pb] : {std::pair{a->weight, b->weight}, std::pair{a->bias, b->bias}}) {
    const at::Tensor g = at::randn(pa.sizes());
    pa.mutable_grad() = g.clone();
    pb.mutable_grad() = g.clone();
  }
}

template <class Optimizer, class Options>
void check_fused_equals_libtorch(bool amsgrad, double weight_decay) {
  CAPTURE(amsgrad);
  CAPTURE(weight_decay);
  torch::manual_seed(3);
  torch::nn::Linear reference(torch::nn::LinearOptions(6, 4));
  torch::nn::Linear fused = copy_of(reference);
  auto groups = [&](torch::nn::Linear& m) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{m->weight},
                   std::make_unique<Options>(Options(2e-2).weight_decay(weight_decay).amsgrad(amsgrad)));
    g.emplace_back(std::vector<at::Tensor>{m->bias}, std::make_unique<Options>(Options(5e-2).amsgrad(amsgrad)));
    return g;
  };
  Optimizer expected(groups(reference), Options(1e-3));
  Optimizer actual(groups(fused), Options(1e-3));
  REQUIRE(fulgur::FusedAdamStep::refusal(actual).empty());
  fulgur::FusedAdamStep capturable(actual);
  capturable.sync_from_host();
  using State = std::conditional_t<std::is_same_v<Optimizer, torch::optim::AdamW>, torch::optim::AdamWParamState,
                                   torch::optim::AdamParamState>;
  const at::Tensor recorded_exp_avg =
      static_cast<State&>(*actual.state().at(fused->weight.unsafeGetTensorImpl())).exp_avg();
  for (int step = 0; step < 8; ++step) {
    if (step == 3)  // a scheduler's change of lr reaches the device copy through refresh_lr
      for (auto* o : {&expected, &actual}) o->param_groups()[0].options().set_lr(7e-3);
    if (step == 5) {
      // Something replaces the optimizer's state (a checkpoint load, lr_finder's restore): new
      // objects, new tensors, other values. The recorded tensors take the values over.
      for (auto* o : {&expected, &actual})
        for (auto& [key, base] : o->state()) {
          auto& old = static_cast<State&>(*base);
          auto fresh = std::make_unique<State>();
          fresh->step(old.step() + 10);
          fresh->exp_avg(old.exp_avg() * 0.5);
          fresh->exp_avg_sq(old.exp_avg_sq() * 2.0);
          if (amsgrad) fresh->max_exp_avg_sq(old.max_exp_avg_sq() * 2.0);
          base = std::move(fresh);
        }
      capturable.adopt_replaced_state();
      auto& now = static_cast<State&>(*actual.state().at(fused->weight.unsafeGetTensorImpl()));
      CHECK(now.exp_avg().is_same(recorded_exp_avg));  // the state points at the recorded tensor again
    }
    same_random_gradients(reference, fused);
    expected.step();
    capturable.refresh_lr();
    capturable.step();
    capturable.advance_host_steps(/*replayed=*/false);
  }
  for (auto [r, f] : {std::pair{reference->weight, fused->weight}, std::pair{reference->bias, fused->bias}}) {
    CHECK(at::allclose(r, f, 1e-5, 1e-6));
    auto& rs = static_cast<State&>(*expected.state().at(r.unsafeGetTensorImpl()));
    auto& fs_ = static_cast<State&>(*actual.state().at(f.unsafeGetTensorImpl()));
    CHECK(rs.step() == 18);
    CHECK(fs_.step() == 18);  // the host counts checkpoints save
    CHECK(at::allclose(rs.exp_avg(), fs_.exp_avg(), 1e-5, 1e-7));
    CHECK(at::allclose(rs.exp_avg_sq(), fs_.exp_avg_sq(), 1e-5, 1e-7));
    if (amsgrad) CHECK(at::allclose(rs.max_exp_avg_sq(), fs_.max_exp_avg_sq(), 1e-5, 1e-7));
  }
  // Betas are recorded into a captured step: changing them is refused, not ignored.
  static_cast<Options&>(actual.param_groups()[1].options()).betas({0.8, 0.99});
  const fulgur::Error changed = fulgur::test::error_from([&] { capturable.check_hyperparameters(); });
  FULGUR_CHECK_CONTAINS(changed.what(), "param group 1 changed betas");
}

// The example (MLP, Adam) on 192 training images: 6 full batches of 32 per epoch, or with
// `train_images` another count (a smaller last batch), for `epochs`. Checkpoint last.ckpt in ckpt/.
fs::path write_job(const fs::path& dir, const std::string& trainer_extra, const std::string& accelerator_table,
                   int train_images, int epochs) {
  const fs::path toml = dir / "job.toml";
  std::ofstream(toml) << "[trainer]\nmax_epochs = " << epochs
                      << "\nseed = 11\nlimit_val_batches = 2\nlimit_test_batches = 1\n"
                         "log_every_n_steps = 1\nenable_progress_bar = false\nnum_sanity_val_steps = 0\n"
                         "default_root_dir = \""
                      << (dir / "runs").string() << "\"\n"
                      << trainer_extra << "[plugins]\npaths = [\"" << (dir / "plugins").string() << "\"]\n"
                      << accelerator_table << "[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\nnum_workers = 0\n"
                      << "val_split = " << (60000 - train_images) << "\n"
                      << "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" << (dir / "ckpt").string()
                      << "\"\nsave_top_k = 0\nsave_last = true\n";
  return toml;
}

ProcessRun run_job(const fs::path& dir, const std::string& trainer_extra, const std::string& accelerator_table = "",
                   int train_images = 192, int epochs = 2) {
  fs::create_directories(dir / "plugins");
  fulgur::test::copy_library(fulgur::test::fixture("libfulgur-fixture-replay-graph.so"),
                             dir / "plugins" / "libfulgur-fixture-replay-graph.so");
  const fs::path toml = write_job(dir, trainer_extra, accelerator_table, train_images, epochs);
  return fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                   {{"FULGUR_LOG_LEVEL", "debug"}}, dir);
}

c10::impl::GenericDict weights_of(const fs::path& checkpoint) {
  c10::IValue value = fulgur::read_checkpoint_file(checkpoint.string());
  REQUIRE(value.isGenericDict());
  return value.toGenericDict().at("state_dict").toGenericDict();
}

double max_weight_difference(const fs::path& a, const fs::path& b) {
  const auto wa = weights_of(a), wb = weights_of(b);
  REQUIRE(wa.size() == wb.size());
  double worst = 0;
  for (const auto& entry : wa)
    worst = std::max(worst, (entry.value().toTensor() - wb.at(entry.key()).toTensor()).abs().max().item<double>());
  return worst;
}

fs::path find_file(const fs::path& root, const std::string& name) {
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.path().filename() == name) return e.path();
  FAIL("no " << name << " under " << root.string());
  return {};
}

// The train/loss column of a run's metrics.csv, one value per step row.
std::vector<double> logged_losses(const fs::path& dir) {
  auto csv = fulgur::test::read_csv(find_file(dir / "runs", "metrics.csv"));
  std::vector<double> losses;
  for (const std::string& cell : csv["train/loss_step"].empty() ? csv["train/loss"] : csv["train/loss_step"])
    if (!cell.empty()) losses.push_back(std::stod(cell));
  return losses;
}

const std::string kReplayAccelerator = "accelerator = \"fixture_replay_graph\"\n";

}  // namespace

TEST_CASE("cuda_graphs: the capturable Adam and AdamW steps equal libtorch's own step()") {
  for (const bool amsgrad : {false, true})
    for (const double weight_decay : {0.0, 0.1}) {
      check_fused_equals_libtorch<torch::optim::Adam, torch::optim::AdamOptions>(amsgrad, weight_decay);
      check_fused_equals_libtorch<torch::optim::AdamW, torch::optim::AdamWOptions>(amsgrad, weight_decay);
    }
  torch::nn::Linear m(torch::nn::LinearOptions(2, 2));
  torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.1));
  FULGUR_CHECK_CONTAINS(fulgur::FusedAdamStep::refusal(sgd), "not torch::optim::Adam or AdamW");
}

TEST_CASE("16-mixed's device decision: the fused step skips where found_inf is 1 and counts only steps taken") {
  for (const bool amsgrad : {false, true}) {
    CAPTURE(amsgrad);
    torch::manual_seed(4);
    torch::nn::Linear reference(torch::nn::LinearOptions(5, 3));
    torch::nn::Linear fused = copy_of(reference);
    torch::optim::AdamW expected(reference->parameters(), torch::optim::AdamWOptions(3e-2).amsgrad(amsgrad));
    torch::optim::AdamW actual(fused->parameters(), torch::optim::AdamWOptions(3e-2).amsgrad(amsgrad));
    fulgur::FusedAdamStep capturable(actual);
    capturable.before_step(/*recorded=*/false);
    const std::vector<bool> skipped = {false, true, false, false, true, true, false};
    for (size_t step = 0; step < skipped.size(); ++step) {
      const at::Tensor before = fused->weight.detach().clone();
      same_random_gradients(reference, fused);
      if (!skipped[step]) expected.step();  // the host's decision: step() only where finite
      capturable.before_step(/*recorded=*/false);
      capturable.step(at::full({}, skipped[step] ? 1.0 : 0.0, at::kFloat));
      capturable.advance_host_steps(/*replayed=*/false);
      CHECK(fused->weight.equal(before) == skipped[step]);
    }
    auto host_step = [&](const at::Tensor& p) {
      return static_cast<torch::optim::AdamWParamState&>(*actual.state().at(p.unsafeGetTensorImpl())).step();
    };
    // Until synchronised, the host counts are provisional (every step counted); then they are
    // the device's: 4 steps taken of 7.
    CHECK(host_step(fused->weight) == 7);
    capturable.sync_host_steps();
    CHECK(host_step(fused->weight) == 4);
    CHECK(host_step(fused->bias) == 4);
    for (auto [r, f] : {std::pair{reference->weight, fused->weight}, std::pair{reference->bias, fused->bias}})
      CHECK(at::allclose(r, f, 1e-5, 1e-6));
    // A state replaced after the last step keeps its own count (it is not overwritten by a
    // count that belongs to the state it replaced).
    capturable.step(at::zeros({}, at::kFloat));
    capturable.advance_host_steps(/*replayed=*/false);
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->step(40);
    fresh->exp_avg(at::zeros_like(fused->bias));
    fresh->exp_avg_sq(at::zeros_like(fused->bias));
    if (amsgrad) fresh->max_exp_avg_sq(at::zeros_like(fused->bias));
    actual.state()[fused->bias.unsafeGetTensorImpl()] = std::move(fresh);
    // Also a state object that is the recorded one by address but holds other tensors (what a
    // new object allocated where a freed one was looks like).
    auto& weight_state =
        static_cast<torch::optim::AdamWParamState&>(*actual.state().at(fused->weight.unsafeGetTensorImpl()));
    capturable.step(at::zeros({}, at::kFloat));  // makes the counts stale again
    capturable.advance_host_steps(/*replayed=*/false);
    weight_state.exp_avg(at::zeros_like(fused->weight));
    weight_state.step(30);
    capturable.sync_host_steps();
    CHECK(host_step(fused->weight) == 30);
    CHECK(host_step(fused->bias) == 40);
  }
}

TEST_CASE("the fused step creates state only for parameters with gradients, as Adam's own step()") {
  torch::nn::Linear m(torch::nn::LinearOptions(3, 2));
  torch::optim::Adam adam(m->parameters(), torch::optim::AdamOptions(1e-2));
  fulgur::FusedAdamStep fused(adam);
  m->weight.mutable_grad() = at::randn(m->weight.sizes());  // the bias is frozen, for now
  for (int step = 0; step < 3; ++step) {
    fused.before_step(/*recorded=*/false);
    fused.step(at::zeros({}, at::kFloat));
    fused.advance_host_steps(/*replayed=*/false);
  }
  fused.sync_host_steps();
  CHECK(adam.state().size() == 1);
  CHECK(adam.state().count(m->bias.unsafeGetTensorImpl()) == 0);
  // Unfrozen: the next step records it, and the weight's count carries on.
  m->bias.mutable_grad() = at::randn(m->bias.sizes());
  fused.before_step(/*recorded=*/false);
  fused.step(at::zeros({}, at::kFloat));
  fused.advance_host_steps(/*replayed=*/false);
  fused.sync_host_steps();
  auto step_of = [&](const at::Tensor& p) {
    return static_cast<torch::optim::AdamParamState&>(*adam.state().at(p.unsafeGetTensorImpl())).step();
  };
  CHECK(step_of(m->weight) == 4);
  CHECK(step_of(m->bias) == 1);
  // A captured step records every parameter up front; a subclass of Adam is refused (its own
  // step() would be bypassed).
  struct MyAdam : torch::optim::Adam {
    using torch::optim::Adam::Adam;
  };
  MyAdam mine(m->parameters(), torch::optim::AdamOptions(1e-2));
  FULGUR_CHECK_CONTAINS(fulgur::FusedAdamStep::refusal(mine), "but a class derived from one");
}

TEST_CASE("cuda_graphs = \"on\": the example warms up, captures once, replays every later step and logs each one") {
  TempDir dir;
  const fs::path off_dir = dir.subdir("off"), on_dir = dir.subdir("on");
  const ProcessRun off = run_job(off_dir, kReplayAccelerator);
  INFO(off.output);
  REQUIRE(off.exit_code == 0);
  const ProcessRun on = run_job(on_dir, kReplayAccelerator + "cuda_graphs = \"on\"\n");
  INFO(on.output);
  REQUIRE(on.exit_code == 0);
  // 12 steps: 3 warm-ups, the capture at the 4th, replayed with it and for the 8 after it.
  FULGUR_CHECK_CONTAINS(off.output, "replay-graph: 0 warm-ups, 0 captures, 0 replays");
  FULGUR_CHECK_CONTAINS(on.output, "replay-graph: 3 warm-ups, 1 captures, 9 replays");
  FULGUR_CHECK_CONTAINS(on.output, "the training step was captured at batch 3 (1 logged values replayed per step)");
  // Batches 2..6 of each epoch are transferred while the step before them runs (the first in line).
  FULGUR_CHECK_CONTAINS(off.output, "replay-graph: 10 staged transfers, 10 finished");
  FULGUR_CHECK_CONTAINS(on.output, "replay-graph: 10 staged transfers, 10 finished");
  // The same training: the fused Adam kernels round differently from libtorch's Adam, no more.
  const double diff = max_weight_difference(off_dir / "ckpt" / "last.ckpt", on_dir / "ckpt" / "last.ckpt");
  CHECK(diff < 1e-4);
  // Every step's loss is logged, from the step that produced it.
  const std::vector<double> expected = logged_losses(off_dir), actual = logged_losses(on_dir);
  REQUIRE(expected.size() == 12);
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(actual[i] - expected[i]) < 1e-3 * std::max(1.0, std::abs(expected[i])));
  }
  // Resumed from the captured run's checkpoint, a third epoch continues its optimizer state (the
  // host step counts: restarting them would change Adam's bias correction by far more than this).
  const fs::path resumed_dir = dir.subdir("resumed"), straight_dir = dir.subdir("straight");
  const ProcessRun resumed = run_job(
      resumed_dir,
      kReplayAccelerator + "cuda_graphs = \"on\"\nckpt_path = \"" + (on_dir / "ckpt" / "last.ckpt").string() + "\"\n",
      "", 192, 3);
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  FULGUR_CHECK_CONTAINS(resumed.output, "replay-graph: 3 warm-ups, 1 captures, 3 replays");
  const ProcessRun straight = run_job(straight_dir, kReplayAccelerator, "", 192, 3);
  REQUIRE(straight.exit_code == 0);
  CHECK(max_weight_difference(straight_dir / "ckpt" / "last.ckpt", resumed_dir / "ckpt" / "last.ckpt") < 1e-4);
}

// Adam's step count of every parameter in a checkpoint (what a resume continues from).
std::vector<double> checkpointed_adam_steps(const fs::path& checkpoint) {
  c10::IValue value = fulgur::read_checkpoint_file(checkpoint.string());
  const c10::IValue optimizer = value.toGenericDict().at("optimizer_states").toListRef().at(0);
  std::vector<double> steps;
  for (const auto& entry : optimizer.toGenericDict().at("state").toGenericDict())
    steps.push_back(entry.value().toGenericDict().at("step").toTensor().item<double>());
  return steps;
}

TEST_CASE("16-mixed decides each step on the device, captured or not, and checkpoints the device's step counts") {
  TempDir dir;
  const fs::path off_dir = dir.subdir("off"), on_dir = dir.subdir("on"), fp32_dir = dir.subdir("fp32");
  const std::string fp16 = "precision = \"16-mixed\"\n";
  const ProcessRun off = run_job(off_dir, kReplayAccelerator + fp16);
  INFO(off.output);
  REQUIRE(off.exit_code == 0);
  const ProcessRun on = run_job(on_dir, kReplayAccelerator + fp16 + "cuda_graphs = \"on\"\n");
  INFO(on.output);
  REQUIRE(on.exit_code == 0);
  const ProcessRun fp32 = run_job(fp32_dir, kReplayAccelerator);
  REQUIRE(fp32.exit_code == 0);
  const std::string device_decided = "optimizer steps are decided on the device";
  FULGUR_CHECK_CONTAINS(off.output, device_decided);
  FULGUR_CHECK_CONTAINS(on.output, device_decided);
  CHECK_FALSE(contains(fp32.output, device_decided));  // 32-true never skips: Adam's own step()
  FULGUR_CHECK_CONTAINS(on.output, "replay-graph: 3 warm-ups, 1 captures, 9 replays");
  CHECK(max_weight_difference(off_dir / "ckpt" / "last.ckpt", on_dir / "ckpt" / "last.ckpt") < 1e-4);
  const std::vector<double> expected = logged_losses(off_dir), actual = logged_losses(on_dir);
  REQUIRE(expected.size() == 12);
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(actual[i] - expected[i]) < 1e-3 * std::max(1.0, std::abs(expected[i])));
  }
  // 12 finite steps: the counts the device kept reached the checkpoint (a skipped step would
  // show as a smaller count; tests/precision_test.cpp injects those).
  for (const fs::path& run : {off_dir, on_dir, fp32_dir}) {
    CAPTURE(run.string());
    const std::vector<double> steps = checkpointed_adam_steps(run / "ckpt" / "last.ckpt");
    REQUIRE_FALSE(steps.empty());
    for (double s : steps) CHECK(s == 12.0);
  }
}

TEST_CASE("cuda_graphs: the step is not captured on an epoch's last batch but on the next one shaped like it") {
  // 128 images: 4 full batches per epoch. Batches 0-2 warm up; batch 3 is the epoch's last (it
  // could be smaller), so it warms up too; the capture is the next epoch's first batch.
  TempDir dir;
  const ProcessRun on = run_job(dir.subdir("on"), kReplayAccelerator + "cuda_graphs = \"on\"\n", "", 128);
  INFO(on.output);
  REQUIRE(on.exit_code == 0);
  FULGUR_CHECK_CONTAINS(on.output, "the training step was captured at batch 0");
  FULGUR_CHECK_CONTAINS(on.output, "replay-graph: 4 warm-ups, 1 captures, 4 replays");
  CHECK(logged_losses(dir.path() / "on").size() == 8);
}

TEST_CASE("cuda_graphs: refusals say why in one line, and \"try\" trains uncaptured instead") {
  TempDir dir;
  SUBCASE("the cpu accelerator cannot capture") {
    const ProcessRun on = run_job(dir.subdir("on"), "cuda_graphs = \"on\"\n");
    INFO(on.output);
    CHECK(on.exit_code != 0);
    FULGUR_CHECK_CONTAINS(on.output,
                          "cuda_graphs = \"on\": the training step cannot be captured: the accelerator of device cpu "
                          "cannot capture steps; use accelerator = \"cuda\". Set cuda_graphs = \"try\"");
    const ProcessRun tried = run_job(dir.subdir("try"), "cuda_graphs = \"try\"\n");
    INFO(tried.output);
    CHECK(tried.exit_code == 0);
    FULGUR_CHECK_CONTAINS(tried.output, "cuda_graphs = \"try\": training uncaptured: the accelerator of device cpu");
    CHECK(fs::exists(dir.path() / "try" / "ckpt" / "last.ckpt"));
  }
  SUBCASE("accumulation, ddp and a value that is not a mode") {
    const ProcessRun accumulate =
        run_job(dir.subdir("acc"), kReplayAccelerator + "cuda_graphs = \"on\"\naccumulate_grad_batches = 2\n");
    CHECK(accumulate.exit_code != 0);
    FULGUR_CHECK_CONTAINS(accumulate.output, "accumulate_grad_batches = 2 alternates steps");
    const ProcessRun ddp =
        run_job(dir.subdir("ddp"), kReplayAccelerator + "cuda_graphs = \"on\"\nstrategy = \"ddp\"\n");
    CHECK(ddp.exit_code != 0);
    FULGUR_CHECK_CONTAINS(ddp.output, "strategy 'ddp' starts its gradient collectives from the host");
    const ProcessRun bogus = run_job(dir.subdir("bogus"), "cuda_graphs = \"yes\"\n");
    CHECK(bogus.exit_code != 0);
    FULGUR_CHECK_CONTAINS(bogus.output, "cuda_graphs = \"yes\": use \"off\", \"on\"");
  }
  SUBCASE("a capture that fails") {
    const std::string failing = "[accelerator]\nfail_capture = true\n";
    const ProcessRun on = run_job(dir.subdir("on"), kReplayAccelerator + "cuda_graphs = \"on\"\n", failing);
    INFO(on.output);
    CHECK(on.exit_code != 0);
    FULGUR_CHECK_CONTAINS(on.output,
                          "the training step cannot be captured: operation not permitted when stream is "
                          "capturing (fixture: fail_capture = true)");
    const ProcessRun tried = run_job(dir.subdir("try"), kReplayAccelerator + "cuda_graphs = \"try\"\n", failing);
    INFO(tried.output);
    CHECK(tried.exit_code == 0);
    FULGUR_CHECK_CONTAINS(tried.output, "replay-graph: 3 warm-ups, 0 captures, 0 replays");
    CHECK(logged_losses(dir.path() / "try").size() == 12);  // the ordinary path took over at step 4
  }
  SUBCASE("a smaller last batch") {
    // 200 images: batches of 32, 32, 32, 32, 32, 32 and 8.
    const ProcessRun on = run_job(dir.subdir("on"), kReplayAccelerator + "cuda_graphs = \"on\"\n", "", 200);
    INFO(on.output);
    CHECK(on.exit_code != 0);
    FULGUR_CHECK_CONTAINS(on.output,
                          "batch input is Float [8, 1, 28, 28], but the captured step was recorded for "
                          "Float [32, 1, 28, 28]");
    const ProcessRun tried = run_job(dir.subdir("try"), kReplayAccelerator + "cuda_graphs = \"try\"\n", "", 200);
    INFO(tried.output);
    CHECK(tried.exit_code == 0);
    FULGUR_CHECK_CONTAINS(tried.output, "this batch trains uncaptured: batch input is Float [8");
    // 14 steps: 3 warm-ups, the capture, 8 replays and 2 uncaptured last batches.
    FULGUR_CHECK_CONTAINS(tried.output, "replay-graph: 3 warm-ups, 1 captures, 9 replays");
    CHECK(logged_losses(dir.path() / "try").size() == 14);
  }
}
