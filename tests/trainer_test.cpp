// The Trainer end to end with the built-in plugins: Lightning's hook order for fit (with sanity
// check and validation), validate, test, predict and resume; exact resume; checkpoints that
// Python opens; bad checkpoints and paths that fail clearly.
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/config_builder.h>
#include <fulgur/data.h>
#include <fulgur/error.h>
#include <fulgur/lr_scheduler.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <c10/core/InferenceMode.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "save_at_step.h"
#include "test_support.h"

namespace {

using fulgur::test::TempDir;
namespace fs = std::filesystem;

using Trace = std::vector<std::string>;

// Records every module hook and step into a shared trace.
struct RecordingModule : fulgur::Module {
  explicit RecordingModule(Trace* trace, bool dropout = false) : trace(trace) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
    if (dropout) drop = register_module("drop", torch::nn::Dropout(0.5));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(fc1->forward(x));
    if (drop) h = drop->forward(h);
    return fc2->forward(h);
  }
  void rec(const char* what) {
    if (trace) trace->push_back(std::string("M.") + what);
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    rec("training_step");
    auto loss = torch::nn::functional::cross_entropy(forward(b.input), b.target);
    log("train/loss", loss, fulgur::LogOptions().prog_bar(true));
    return {loss};
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t) override {
    rec("validation_step");
    auto out = forward(b.input);
    log("val/loss", torch::nn::functional::cross_entropy(out, b.target));
    log("val/acc", out.argmax(1).eq(b.target).to(at::kFloat).mean());
    return {};
  }
  fulgur::StepOutput test_step(const fulgur::Batch& b, int64_t) override {
    rec("test_step");
    log("test/acc", forward(b.input).argmax(1).eq(b.target).to(at::kFloat).mean());
    return {};
  }
  at::Tensor predict_step(const fulgur::Batch& b, int64_t) override {
    rec("predict_step");
    return forward(b.input).argmax(1);
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    rec("configure_optimizers");
    return {
        fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2)))};
  }
  fulgur::Batch on_before_batch_transfer(fulgur::Batch b) override {
    rec("on_before_batch_transfer");
    return b;
  }
  fulgur::Batch transfer_batch_to_device(fulgur::Batch b, const c10::Device& d) override {
    rec("transfer_batch_to_device");
    return fulgur::Module::transfer_batch_to_device(std::move(b), d);
  }
  fulgur::Batch on_after_batch_transfer(fulgur::Batch b) override {
    rec("on_after_batch_transfer");
    return b;
  }
  void on_fit_start() override { rec("on_fit_start"); }
  void on_fit_end() override { rec("on_fit_end"); }
  void on_train_start() override { rec("on_train_start"); }
  void on_train_end() override { rec("on_train_end"); }
  void on_train_epoch_start() override { rec("on_train_epoch_start"); }
  void on_train_epoch_end() override { rec("on_train_epoch_end"); }
  void on_validation_epoch_start() override { rec("on_validation_epoch_start"); }
  void on_validation_epoch_end() override { rec("on_validation_epoch_end"); }
  void on_test_epoch_start() override { rec("on_test_epoch_start"); }
  void on_test_epoch_end() override { rec("on_test_epoch_end"); }
  void on_train_batch_start(const fulgur::Batch&, int64_t) override { rec("on_train_batch_start"); }
  void on_train_batch_end(const fulgur::StepOutput&, const fulgur::Batch&, int64_t) override {
    rec("on_train_batch_end");
  }
  void on_before_backward(const at::Tensor&) override { rec("on_before_backward"); }
  void on_after_backward() override { rec("on_after_backward"); }
  void on_before_optimizer_step(torch::optim::Optimizer&) override { rec("on_before_optimizer_step"); }
  void on_before_zero_grad(torch::optim::Optimizer&) override { rec("on_before_zero_grad"); }

  Trace* trace;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};

// Records every callback hook; declares them all.
struct RecordingCallback : fulgur::Callback {
  explicit RecordingCallback(Trace* trace) : trace(trace) {}
  void rec(const char* what) { trace->push_back(std::string("C.") + what); }
  fulgur::HookSet hooks() const override { return ~fulgur::HookSet{0}; }
  void setup(fulgur::TrainerContext&, fulgur::Stage) override { rec("setup"); }
  void teardown(fulgur::TrainerContext&, fulgur::Stage) override { rec("teardown"); }
  void on_fit_start(fulgur::TrainerContext&) override { rec("on_fit_start"); }
  void on_fit_end(fulgur::TrainerContext&) override { rec("on_fit_end"); }
  void on_sanity_check_start(fulgur::TrainerContext&) override { rec("on_sanity_check_start"); }
  void on_sanity_check_end(fulgur::TrainerContext&) override { rec("on_sanity_check_end"); }
  void on_train_start(fulgur::TrainerContext&) override { rec("on_train_start"); }
  void on_train_end(fulgur::TrainerContext&) override { rec("on_train_end"); }
  void on_train_epoch_start(fulgur::TrainerContext&) override { rec("on_train_epoch_start"); }
  void on_train_epoch_end(fulgur::TrainerContext&) override { rec("on_train_epoch_end"); }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    rec("on_train_batch_start");
  }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&, int64_t) override {
    rec("on_train_batch_end");
  }
  void on_validation_start(fulgur::TrainerContext&) override { rec("on_validation_start"); }
  void on_validation_end(fulgur::TrainerContext&) override { rec("on_validation_end"); }
  void on_validation_epoch_start(fulgur::TrainerContext&) override { rec("on_validation_epoch_start"); }
  void on_validation_epoch_end(fulgur::TrainerContext&) override { rec("on_validation_epoch_end"); }
  void on_validation_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    rec("on_validation_batch_start");
  }
  void on_validation_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&,
                               int64_t) override {
    rec("on_validation_batch_end");
  }
  void on_test_start(fulgur::TrainerContext&) override { rec("on_test_start"); }
  void on_test_end(fulgur::TrainerContext&) override { rec("on_test_end"); }
  void on_test_epoch_start(fulgur::TrainerContext&) override { rec("on_test_epoch_start"); }
  void on_test_epoch_end(fulgur::TrainerContext&) override { rec("on_test_epoch_end"); }
  void on_test_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    rec("on_test_batch_start");
  }
  void on_test_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&, int64_t) override {
    rec("on_test_batch_end");
  }
  void on_predict_start(fulgur::TrainerContext&) override { rec("on_predict_start"); }
  void on_predict_end(fulgur::TrainerContext&) override { rec("on_predict_end"); }
  void on_predict_epoch_start(fulgur::TrainerContext&) override { rec("on_predict_epoch_start"); }
  void on_predict_epoch_end(fulgur::TrainerContext&) override { rec("on_predict_epoch_end"); }
  void on_predict_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    rec("on_predict_batch_start");
  }
  void on_predict_batch_end(fulgur::TrainerContext&, const at::Tensor&, const fulgur::Batch&, int64_t) override {
    rec("on_predict_batch_end");
  }
  void on_before_backward(fulgur::TrainerContext&, const at::Tensor&) override { rec("on_before_backward"); }
  void on_after_backward(fulgur::TrainerContext&) override { rec("on_after_backward"); }
  void on_before_optimizer_step(fulgur::TrainerContext&, torch::optim::Optimizer&) override {
    rec("on_before_optimizer_step");
  }
  void on_before_zero_grad(fulgur::TrainerContext&, torch::optim::Optimizer&) override { rec("on_before_zero_grad"); }
  void on_exception(fulgur::TrainerContext&, const std::exception&) override { rec("on_exception"); }
  void on_save_checkpoint(fulgur::TrainerContext&, c10::IValue&) override { rec("on_save_checkpoint"); }
  void on_load_checkpoint(fulgur::TrainerContext&, const c10::IValue&) override { rec("on_load_checkpoint"); }
  std::string state_key() const override { return "Recorder"; }
  void state_dict(c10::IValue& out) const override {
    auto d = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
    d.insert("calls", static_cast<int64_t>(trace->size()));
    out = d;
  }
  void load_state_dict(const c10::IValue&) override { rec("load_state_dict"); }

  Trace* trace;
};

using fulgur::test::SaveAtStep;

// 3-class synthetic data: deterministic, small, learnable.
struct SyntheticData : fulgur::DataModule {
  explicit SyntheticData(int64_t n = 64, int64_t batch = 16) : batch(batch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    x = at::randn({n, 8}, gen);
    y = (x.slice(1, 0, 1).squeeze(1) > 0).to(at::kLong) + (x.slice(1, 1, 2).squeeze(1) > 0.5).to(at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    ++train_loader_calls;
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch).shuffle(true).seed(7));
  }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch));
  }
  std::unique_ptr<fulgur::BatchLoader> test_loader() override { return val_loader(); }
  std::unique_ptr<fulgur::BatchLoader> predict_loader() override { return val_loader(); }
  int64_t batch;
  at::Tensor x, y;
  int train_loader_calls = 0;
};

fulgur::Config config_from(const TempDir& dir, const std::string& trainer_keys, const std::string& extra = "") {
  std::string text = fmt::format(R"(
[trainer]
default_root_dir = "{}"
seed = 3
enable_progress_bar = false
enable_model_summary = false
{}
{}
)",
                                 dir.path().string(), trainer_keys, extra);
  return fulgur::parse_config(text, dir / "test.toml");
}

std::vector<std::string> batch_transfer() {
  return {"M.on_before_batch_transfer", "M.transfer_batch_to_device", "M.on_after_batch_transfer"};
}

void append(Trace& t, const std::vector<std::string>& more) { t.insert(t.end(), more.begin(), more.end()); }

Trace validation_sequence(int batches) {
  Trace t{"C.on_validation_start", "C.on_validation_epoch_start", "M.on_validation_epoch_start"};
  for (int i = 0; i < batches; ++i) {
    append(t, batch_transfer());
    append(t, {"C.on_validation_batch_start", "M.validation_step", "C.on_validation_batch_end"});
  }
  append(t, {"C.on_validation_epoch_end", "M.on_validation_epoch_end", "C.on_validation_end"});
  return t;
}

Trace train_batch_sequence() {
  Trace t = batch_transfer();
  append(t, {"C.on_train_batch_start", "M.on_train_batch_start", "M.training_step", "C.on_before_zero_grad",
             "M.on_before_zero_grad", "C.on_before_backward", "M.on_before_backward", "C.on_after_backward",
             "M.on_after_backward", "C.on_before_optimizer_step", "M.on_before_optimizer_step", "C.on_train_batch_end",
             "M.on_train_batch_end"});
  return t;
}

std::string show(const Trace& t) { return fmt::format("{}", fmt::join(t, "\n")); }

void check_trace(const Trace& actual, const Trace& expected) {
  INFO("actual:\n" << show(actual) << "\n\nexpected:\n" << show(expected));
  CHECK(actual == expected);
}

std::map<std::string, at::Tensor> weights(fulgur::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

}  // namespace

TEST_CASE("fit calls hooks in Lightning's order, with sanity check and end-of-epoch validation") {
  TempDir dir;
  Trace trace;
  fulgur::Trainer trainer(config_from(dir, R"(
max_epochs = 1
limit_train_batches = 2
limit_val_batches = 1
num_sanity_val_steps = 1
enable_checkpointing = false
logger = false)"));
  trainer.add_callback(std::make_shared<RecordingCallback>(&trace));
  RecordingModule module(&trace);
  SyntheticData data;
  trainer.fit(module, data);

  Trace expected{"C.setup", "M.configure_optimizers", "C.on_fit_start", "M.on_fit_start", "C.on_sanity_check_start"};
  append(expected, validation_sequence(1));
  append(expected, {"C.on_sanity_check_end", "C.on_train_start", "M.on_train_start", "C.on_train_epoch_start",
                    "M.on_train_epoch_start"});
  append(expected, train_batch_sequence());
  append(expected, train_batch_sequence());
  append(expected, validation_sequence(1));
  append(expected, {"C.on_train_epoch_end", "M.on_train_epoch_end", "C.on_train_end", "M.on_train_end", "C.on_fit_end",
                    "M.on_fit_end", "C.teardown"});
  check_trace(trace, expected);
  CHECK(trainer.global_step() == 2);
  CHECK(trainer.current_epoch() == 1);
  CHECK(trainer.callback_metrics().count("val/acc") == 1);
}

TEST_CASE("validate, test and predict call their hooks in Lightning's order") {
  TempDir dir;
  Trace trace;
  fulgur::Trainer trainer(config_from(dir,
                                      "limit_val_batches = 2\nlimit_test_batches = 1\nlimit_predict_batches = 2\n"
                                      "enable_checkpointing = false\nlogger = false"));
  trainer.add_callback(std::make_shared<RecordingCallback>(&trace));
  RecordingModule module(&trace);
  SyntheticData data;

  auto results = trainer.validate(module, data);
  Trace expected{"C.setup"};
  append(expected, validation_sequence(2));
  append(expected, {"C.teardown"});
  check_trace(trace, expected);
  REQUIRE(results.size() == 1);
  CHECK(results[0].count("val/acc") == 1);
  CHECK(results[0].count("val/loss") == 1);

  trace.clear();
  auto test_results = trainer.test(module, data);
  expected = {"C.setup", "C.on_test_start", "C.on_test_epoch_start", "M.on_test_epoch_start"};
  append(expected, batch_transfer());
  append(expected, {"C.on_test_batch_start", "M.test_step", "C.on_test_batch_end", "C.on_test_epoch_end",
                    "M.on_test_epoch_end", "C.on_test_end", "C.teardown"});
  check_trace(trace, expected);
  CHECK(test_results.at(0).count("test/acc") == 1);

  trace.clear();
  auto predictions = trainer.predict(module, data);
  expected = {"C.setup", "C.on_predict_start", "C.on_predict_epoch_start"};
  for (int i = 0; i < 2; ++i) {
    append(expected, batch_transfer());
    append(expected, {"C.on_predict_batch_start", "M.predict_step", "C.on_predict_batch_end"});
  }
  append(expected, {"C.on_predict_epoch_end", "C.on_predict_end", "C.teardown"});
  check_trace(trace, expected);
  REQUIRE(predictions.size() == 2);
  CHECK(predictions[0].size(0) == 16);
}

TEST_CASE("resume restores callbacks before on_fit_start and training state after it") {
  TempDir dir;
  fs::path ckpt = dir / "mid.ckpt";
  {
    Trace ignored;
    fulgur::Trainer trainer(
        config_from(dir, "max_steps = 3\nlimit_val_batches = 0\nenable_checkpointing = false\nlogger = false"));
    trainer.add_callback(std::make_shared<RecordingCallback>(&ignored));
    trainer.add_callback(std::make_shared<SaveAtStep>(3, ckpt.string()));
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data);
  }
  Trace trace;
  fulgur::Trainer trainer(
      config_from(dir, "max_steps = 4\nlimit_val_batches = 0\nenable_checkpointing = false\nlogger = false"));
  trainer.add_callback(std::make_shared<RecordingCallback>(&trace));
  RecordingModule module(&trace);
  SyntheticData data;
  trainer.fit(module, data, ckpt.string());
  Trace head(trace.begin(), trace.begin() + std::min<size_t>(trace.size(), 8));
  check_trace(head, {"C.setup", "M.configure_optimizers", "C.on_load_checkpoint", "C.load_state_dict", "C.on_fit_start",
                     "M.on_fit_start", "C.on_train_start", "M.on_train_start"});
  CHECK(trainer.global_step() == 4);
}

TEST_CASE("exact resume: k steps, new trainer, resume to N equals N straight steps bitwise (mid-epoch, dropout)") {
  // 64 samples / batch 16 = 4 batches per epoch; N = 10 steps; stop at k = 6 (inside epoch 1).
  TempDir dir;
  const std::string common =
      "limit_val_batches = 0\nenable_checkpointing = false\nlogger = false\ndeterministic = true";
  std::map<std::string, at::Tensor> straight;
  {
    fulgur::Trainer trainer(config_from(dir, "max_steps = 10\n" + common));
    RecordingModule module(nullptr, /*dropout=*/true);
    SyntheticData data;
    trainer.fit(module, data);
    straight = weights(module);
  }
  fs::path ckpt = dir / "k6.ckpt";
  {
    // The "killed" run: it saves at step 6, in the middle of epoch 1, then stops.
    fulgur::Trainer trainer(config_from(dir, "max_steps = 6\n" + common));
    trainer.add_callback(std::make_shared<SaveAtStep>(6, ckpt.string()));
    RecordingModule module(nullptr, true);
    SyntheticData data;
    trainer.fit(module, data);
    CHECK(trainer.global_step() == 6);
  }
  fulgur::Trainer trainer(config_from(dir, "max_steps = 10\n" + common));
  RecordingModule module(nullptr, true);
  SyntheticData data;
  trainer.fit(module, data, ckpt.string());
  CHECK(trainer.global_step() == 10);
  auto resumed = weights(module);
  REQUIRE(resumed.size() == straight.size());
  for (const auto& [name, t] : straight) {
    INFO(name);
    CHECK(at::equal(resumed.at(name), t));
  }
}

TEST_CASE("a checkpoint opens in Python with torch.load(weights_only=True), with Lightning's keys") {
  TempDir dir;
  fs::path ckpt = dir / "model.ckpt";
  fulgur::Trainer trainer(
      config_from(dir, "max_steps = 2\nlimit_val_batches = 0\nenable_checkpointing = false\nlogger = false",
                  "[model]\nlr = 0.01\nwidth = 16\n"));
  RecordingModule module(nullptr);
  SyntheticData data;
  trainer.fit(module, data);
  trainer.save_checkpoint(ckpt.string());
  const float w00 = module.fc1->weight[0][0].item<float>();

  fs::path script = dir / "check.py";
  std::ofstream(script) << fmt::format(R"(
import sys, torch
d = torch.load(sys.argv[1], weights_only=True)
for key in ["epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers", "callbacks", "loops",
            "hyper_parameters", "pytorch-lightning_version"]:
    assert key in d, key
sd = d["state_dict"]
assert sorted(sd.keys()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], sorted(sd.keys())
assert tuple(sd["fc1.weight"].shape) == (16, 8)
assert abs(sd["fc1.weight"][0][0].item() - {}) < 1e-7
assert d["global_step"] == 2
assert d["hyper_parameters"]["lr"] == 0.01 and d["hyper_parameters"]["width"] == 16
opt = d["optimizer_states"][0]
assert opt["param_groups"][0]["lr"] == 0.01 and len(opt["param_groups"][0]["params"]) == 4
assert set(opt["state"][0].keys()) >= {{"step", "exp_avg", "exp_avg_sq"}}
assert int(opt["state"][0]["step"]) == 2
print("python-ok")
)",
                                       w00);
  const auto [status, output] =
      fulgur::test::run_command(fmt::format("{} {} {}", FULGUR_TEST_PYTHON, script.string(), ckpt.string()));
  INFO(output);
  CHECK(status == 0);
  CHECK(output.find("python-ok") != std::string::npos);
}

// Runs a Python check script on a checkpoint; true when it prints "python-ok".
bool python_checks_checkpoint(const TempDir& dir, const std::string& code, const fs::path& ckpt) {
  fs::path script = dir / "loops_check.py";
  std::ofstream(script) << code;
  const auto [status, output] =
      fulgur::test::run_command(fmt::format("{} {} {}", FULGUR_TEST_PYTHON, script.string(), ckpt.string()));
  INFO(output);
  return status == 0 && output.find("python-ok") != std::string::npos;
}

TEST_CASE("every loop keeps its own state in the checkpoint and gets it back on resume") {
  TempDir dir;
  // 4 batches per epoch, validation at every epoch's end; the sanity check is not a pass.
  const std::string keys = "limit_val_batches = 2\nenable_checkpointing = false\nlogger = false\n";
  fs::path first = dir / "first.ckpt", second = dir / "second.ckpt";
  {
    fulgur::Trainer trainer(config_from(dir, "max_epochs = 2\n" + keys, "[model]\nlr = 0.01\nwidth = 16\n"));
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data);
    trainer.validate(module, data);
    trainer.test(module, data);
    trainer.test(module, data);
    trainer.predict(module, data);
    trainer.save_checkpoint(first.string());
  }
  CHECK(python_checks_checkpoint(dir, R"(
import sys, torch
loops = torch.load(sys.argv[1], weights_only=True)["loops"]
assert sorted(loops) == ["fit_loop", "predict_loop", "test_loop", "validate_loop"], sorted(loops)
fit = loops["fit_loop"]
assert fit["epoch"] == 2 and fit["global_step"] == 8 and fit["batches_done_in_epoch"] == 0, fit
# Fulgur's own keys; Lightning's progress keys sit beside them (lightning_checkpoint_test.cpp).
def own(loop, keys=("dataloader_idx", "batches_done", "completed_passes")):
    return {k: loop[k] for k in keys}
assert own(fit["val_loop"]) == {"dataloader_idx": 0, "batches_done": 2, "completed_passes": 2}, fit["val_loop"]
assert own(loops["validate_loop"]) == {"dataloader_idx": 0, "batches_done": 2, "completed_passes": 1}, loops["validate_loop"]
assert own(loops["test_loop"]) == {"dataloader_idx": 0, "batches_done": 4, "completed_passes": 2}, loops["test_loop"]
assert own(loops["predict_loop"], ("batches_done", "completed_passes")) == {"batches_done": 4, "completed_passes": 1}
assert fit["epoch_progress"]["total"] == {"ready": 2, "started": 2, "processed": 2, "completed": 2}, fit["epoch_progress"]
assert fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"] == 8
assert loops["test_loop"]["batch_progress"]["current"]["completed"] == 4, loops["test_loop"]
print("python-ok")
)",
                                 first));
  {
    // Resumed for one more epoch: every loop starts from its saved state, not from zero.
    fulgur::Trainer trainer(config_from(dir, "max_epochs = 3\n" + keys, "[model]\nlr = 0.01\nwidth = 16\n"));
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data, first.string());
    CHECK(trainer.current_epoch() == 3);
    CHECK(trainer.global_step() == 12);
    trainer.save_checkpoint(second.string());
  }
  CHECK(python_checks_checkpoint(dir, R"(
import sys, torch
loops = torch.load(sys.argv[1], weights_only=True)["loops"]
assert loops["fit_loop"]["epoch"] == 3 and loops["fit_loop"]["global_step"] == 12, loops["fit_loop"]
assert loops["fit_loop"]["val_loop"]["completed_passes"] == 3, loops["fit_loop"]["val_loop"]
assert loops["validate_loop"]["completed_passes"] == 1, loops["validate_loop"]
assert loops["test_loop"]["completed_passes"] == 2, loops["test_loop"]
assert loops["predict_loop"]["completed_passes"] == 1, loops["predict_loop"]
print("python-ok")
)",
                                 second));
}

namespace {

// Two validation sets of different sizes (4 and 2 batches); test uses the same two.
struct TwoValidationSets : SyntheticData {
  std::vector<std::unique_ptr<fulgur::BatchLoader>> val_loaders() override {
    std::vector<std::unique_ptr<fulgur::BatchLoader>> loaders;
    loaders.push_back(fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch)));
    loaders.push_back(fulgur::make_tensor_loader(x.slice(0, 0, 32), y.slice(0, 0, 32),
                                                 fulgur::TensorLoaderOptions().batch_size(batch)));
    return loaders;
  }
  std::vector<std::unique_ptr<fulgur::BatchLoader>> test_loaders() override { return val_loaders(); }
};

// Records (dataloader_idx, batch_idx) of every validation step; logs one value per loader.
struct PerLoaderModule : RecordingModule {
  PerLoaderModule() : RecordingModule(nullptr) {}
  fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t batch_idx, int64_t dataloader_idx) override {
    steps.emplace_back(dataloader_idx, batch_idx);
    log("val/loss", torch::nn::functional::cross_entropy(forward(b.input), b.target));
    return {};
  }
  fulgur::StepOutput test_step(const fulgur::Batch& b, int64_t, int64_t dataloader_idx) override {
    log("test/acc", forward(b.input).argmax(1).eq(b.target).to(at::kFloat).mean() + double(dataloader_idx));
    return {};
  }
  std::vector<std::pair<int64_t, int64_t>> steps;
};

// What a callback sees of the loader index through TrainerContext.
struct LoaderIndexProbe : fulgur::Callback {
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::validation_batch_start); }
  void on_validation_batch_start(fulgur::TrainerContext& t, const fulgur::Batch&, int64_t) override {
    seen.push_back(t.dataloader_idx());
  }
  std::vector<int64_t> seen;
};

}  // namespace

TEST_CASE("several validation and test loaders: dataloader_idx reaches steps and callbacks, names get suffixes") {
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir, "max_epochs = 1\nnum_sanity_val_steps = 1\nenable_checkpointing = false\n",
                                      "[[loggers]]\nname = \"csv\"\n"));
  auto probe = std::make_shared<LoaderIndexProbe>();
  trainer.add_callback(probe, "probe");
  PerLoaderModule module;
  TwoValidationSets data;
  trainer.fit(module, data);
  // Sanity check: one batch of each loader; then the epoch's validation: 4 + 2 batches.
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 0}, {1, 0}, {0, 0}, {0, 1},
                                                             {0, 2}, {0, 3}, {1, 0}, {1, 1}};
  CHECK(module.steps == expected);
  CHECK(probe->seen == std::vector<int64_t>{0, 1, 0, 0, 0, 0, 1, 1});
  const auto& logged = trainer.logged_metrics();
  CHECK(logged.count("val/loss/dataloader_idx_0") == 1);
  CHECK(logged.count("val/loss/dataloader_idx_1") == 1);
  CHECK(logged.count("val/loss") == 0);
  CHECK(logged.at("val/loss/dataloader_idx_0") != logged.at("val/loss/dataloader_idx_1"));

  // Trainer::test returns one dict per loader, each with its own values.
  const std::vector<fulgur::MetricMap> results = trainer.test(module, data);
  REQUIRE(results.size() == 2);
  CHECK(results[0].count("test/acc/dataloader_idx_0") == 1);
  CHECK(results[0].count("test/acc/dataloader_idx_1") == 0);
  CHECK(results[1].count("test/acc/dataloader_idx_1") == 1);
  CHECK(results[1].at("test/acc/dataloader_idx_1") >= 1.0);  // its step added its index
  CHECK(results[0].at("test/acc/dataloader_idx_0") <= 1.0);
  // The CSV logger's file has a column per loader.
  std::string csv;
  for (const auto& e : fs::recursive_directory_iterator(dir.path()))
    if (e.path().filename() == "metrics.csv") csv = fulgur::test::read_bytes(e.path());
  FULGUR_CHECK_CONTAINS(csv, "val/loss/dataloader_idx_1");
}

TEST_CASE("reload_dataloaders_every_n_epochs asks the DataModule for new loaders every N epochs, from TOML") {
  for (const auto& [every, calls] : std::vector<std::pair<int, int>>{{0, 1}, {1, 4}, {2, 2}, {3, 2}}) {
    INFO("reload_dataloaders_every_n_epochs = " << every);
    TempDir dir;
    fulgur::Trainer trainer(config_from(
        dir, fmt::format(
                 "max_epochs = 4\nreload_dataloaders_every_n_epochs = {}\nenable_checkpointing = false\nlogger = false",
                 every)));
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data);
    CHECK(data.train_loader_calls == calls);
    CHECK(trainer.global_step() == 16);
  }
  TempDir dir;
  CHECK_THROWS_WITH_AS(fulgur::Trainer(config_from(dir, "reload_dataloaders_every_n_epochs = -1")),
                       doctest::Contains("reload_dataloaders_every_n_epochs = -1: must be >= 0"), fulgur::Error);
}

TEST_CASE("bad checkpoints fail clearly and lose nothing") {
  TempDir dir;
  const std::string keys = "max_steps = 2\nlimit_val_batches = 0\nenable_checkpointing = false\nlogger = false";
  fs::path good = dir / "good.ckpt";
  {
    fulgur::Trainer trainer(config_from(dir, keys));
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data);
    trainer.save_checkpoint(good.string());
  }
  const std::string good_bytes = fulgur::test::read_bytes(good);

  SUBCASE("truncated file") {
    fs::path truncated = dir / "truncated.ckpt";
    std::ofstream(truncated, std::ios::binary) << good_bytes.substr(0, good_bytes.size() / 2);
    fulgur::Trainer trainer(config_from(dir, keys));
    RecordingModule module(nullptr);
    SyntheticData data;
    try {
      trainer.fit(module, data, truncated.string());
      FAIL("expected an error");
    } catch (const fulgur::Error& e) {
      CHECK(e.kind() == fulgur::ErrorKind::checkpoint);
      CHECK(std::string(e.what()).find(truncated.string()) != std::string::npos);
    }
  }
  SUBCASE("not a checkpoint at all") {
    fs::path junk = dir / "junk.ckpt";
    std::ofstream(junk) << "this is not a zip archive";
    fulgur::Trainer trainer(config_from(dir, keys));
    RecordingModule module(nullptr);
    SyntheticData data;
    CHECK_THROWS_AS(trainer.fit(module, data, junk.string()), fulgur::Error);
  }
  SUBCASE("a checkpoint of another model lists missing and unexpected keys") {
    struct Other : fulgur::Module {
      Other() { head = register_module("head", torch::nn::Linear(8, 3)); }
      fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
        return {torch::nn::functional::cross_entropy(head->forward(b.input), b.target)};
      }
      std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
        return {fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters()))};
      }
      torch::nn::Linear head{nullptr};
    };
    fulgur::Trainer trainer(config_from(dir, keys));
    Other module;
    SyntheticData data;
    try {
      trainer.fit(module, data, good.string());
      FAIL("expected an error");
    } catch (const fulgur::Error& e) {
      const std::string message = e.what();
      CHECK(e.kind() == fulgur::ErrorKind::checkpoint);
      CHECK(message.find("missing keys: head.bias, head.weight") != std::string::npos);
      CHECK(message.find("unexpected keys: fc1.bias") != std::string::npos);
    }
  }
  SUBCASE("ckpt_path=\"last\" with nothing saved") {
    TempDir empty;
    fulgur::Trainer trainer(config_from(empty, keys));
    RecordingModule module(nullptr);
    SyntheticData data;
    // fit: the first run of a job that always says "last" starts fresh (Lightning's behaviour)...
    trainer.fit(module, data, "last");
    CHECK(trainer.global_step() > 0);
    // ... but evaluating "last" when there is none is an error that says so.
    fulgur::Trainer evaluator(config_from(empty, keys));
    try {
      evaluator.validate(module, data, "last");
      FAIL("expected an error");
    } catch (const fulgur::Error& e) {
      CHECK(e.kind() == fulgur::ErrorKind::checkpoint);
      CHECK(std::string(e.what()).find("no last checkpoint is known") != std::string::npos);
    }
  }
  CHECK(fulgur::test::read_bytes(good) == good_bytes);  // nothing lost
}

TEST_CASE("a model_checkpoint monitoring a metric that is never logged fails with the available names") {
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 1\nlimit_train_batches = 2\nlimit_val_batches = 1\nlogger = false",
                                      "[[callbacks]]\nname = \"model_checkpoint\"\nmonitor = \"val/accuracy\"\n"));
  RecordingModule module(nullptr);
  SyntheticData data;
  try {
    trainer.fit(module, data);
    FAIL("expected an error");
  } catch (const fulgur::Error& e) {
    const std::string message = e.what();
    CHECK(message.find("val/accuracy") != std::string::npos);
    CHECK(message.find("val/acc") != std::string::npos);
  }
}

TEST_CASE("gradient accumulation steps the optimizer once per window and logs to csv") {
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 2\naccumulate_grad_batches = 2\nlog_every_n_steps = 1\n"
                                      "limit_val_batches = 1\nnum_sanity_val_steps = 0\nenable_checkpointing = false",
                                      "[[loggers]]\nname = \"csv\"\n"));
  RecordingModule module(nullptr);
  SyntheticData data;
  trainer.fit(module, data);
  CHECK(trainer.global_step() == 4);  // 4 batches per epoch / 2 * 2 epochs
  fs::path metrics = fs::path(trainer.log_dir()) / "metrics.csv";
  REQUIRE(fs::exists(metrics));
  const std::string csv = fulgur::test::read_bytes(metrics);
  CHECK(csv.find("train/loss") != std::string::npos);
  CHECK(csv.find("val/acc") != std::string::npos);
}

// ---- defects found in review (issue #11), each with the test that caught it ----------------------

namespace {

// A loader that does not know its length (num_batches() == -1, as a stream would answer).
struct UnknownLength : fulgur::BatchLoader {
  explicit UnknownLength(std::unique_ptr<fulgur::BatchLoader> inner) : inner(std::move(inner)) {}
  int64_t num_batches() const override { return -1; }
  void start_epoch(int64_t epoch, int64_t skip) override { inner->start_epoch(epoch, skip); }
  std::optional<fulgur::Batch> next() override { return inner->next(); }
  void set_replica(int64_t rank, int64_t n) override { inner->set_replica(rank, n); }
  std::unique_ptr<fulgur::BatchLoader> inner;
};

struct UnknownLengthData : SyntheticData {
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return std::make_unique<UnknownLength>(SyntheticData::train_loader());
  }
};

// Logs the epoch it is in from on_train_epoch_end, as Lightning users do for epoch summaries.
struct EpochEndLogger : RecordingModule {
  EpochEndLogger() : RecordingModule(nullptr) {}
  void on_train_epoch_end() override { log("epoch_marker", static_cast<double>(epochs_ended++)); }
  int64_t epochs_ended = 0;
};

// metrics.csv as rows of column -> text (empty cells left out).
std::vector<std::map<std::string, std::string>> csv_rows(const fs::path& file) {
  std::istringstream in(fulgur::test::read_bytes(file));
  auto split = [](const std::string& line) {
    std::vector<std::string> cells;
    std::string cell;
    std::istringstream s(line);
    while (std::getline(s, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    return cells;
  };
  std::string line;
  std::getline(in, line);
  const std::vector<std::string> header = split(line);
  std::vector<std::map<std::string, std::string>> rows;
  while (std::getline(in, line)) {
    const auto cells = split(line);
    std::map<std::string, std::string> row;
    for (size_t i = 0; i < cells.size() && i < header.size(); ++i)
      if (!cells[i].empty()) row[header[i]] = cells[i];
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace

TEST_CASE("a training loader of unknown length trains until it is exhausted, and max_steps alone ends fit") {
  TempDir dir;
  {
    fulgur::Trainer trainer(config_from(dir, "max_epochs = 2\nlogger = false\nenable_checkpointing = false"));
    RecordingModule module(nullptr);
    UnknownLengthData data;
    trainer.fit(module, data);
    CHECK(trainer.global_step() == 8);  // 64 samples / 16 per batch, twice (was 0: no batch trained)
  }
  {
    // No max_epochs: max_steps must end it (it used to run forever).
    fulgur::Trainer trainer(config_from(dir, "max_steps = 6\nlogger = false\nenable_checkpointing = false"));
    RecordingModule module(nullptr);
    UnknownLengthData data;
    trainer.fit(module, data);
    CHECK(trainer.global_step() == 6);
  }
}

TEST_CASE("no logger row carries step -1, and values logged in on_train_epoch_end land in their own epoch") {
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 3\naccumulate_grad_batches = 2\nlog_every_n_steps = 1\n"
                                      "limit_val_batches = 1\nnum_sanity_val_steps = 0\nenable_checkpointing = false",
                                      "[[loggers]]\nname = \"csv\"\n"));
  EpochEndLogger module;
  SyntheticData data;
  trainer.fit(module, data);
  const auto rows = csv_rows(fs::path(trainer.log_dir()) / "metrics.csv");
  REQUIRE(!rows.empty());
  std::vector<std::string> marker_epochs;
  for (const auto& row : rows) {
    REQUIRE(row.count("step") == 1);
    CHECK(std::stoll(row.at("step")) >= 0);
    if (row.count("epoch_marker")) {
      REQUIRE(row.count("epoch") == 1);
      CHECK(std::stod(row.at("epoch_marker")) == std::stod(row.at("epoch")));
      marker_epochs.push_back(row.at("epoch"));
    }
  }
  CHECK(marker_epochs.size() == 3);  // one per epoch, none late, none lost
}

// ---- every [trainer] key changes behaviour or is rejected ---------------------------------------

namespace {

// Records what a run did, including the global switches some keys flip, as text to compare.
struct ProbeModule : RecordingModule {
  explicit ProbeModule(Trace* trace) : RecordingModule(trace) {}
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t i) override {
    trace->push_back(fmt::format("flags deterministic={} anomaly={}", at::globalContext().deterministicAlgorithms(),
                                 torch::autograd::AnomalyMode::is_enabled()));
    return RecordingModule::training_step(b, i);
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t i) override {
    trace->push_back(fmt::format("flags inference_mode={}", c10::InferenceMode::is_enabled()));
    return RecordingModule::validation_step(b, i);
  }
};

// Every file under `dir` (names; contents only of metrics.csv, the logged rows) as text.
std::string files_below(const fs::path& dir) {
  std::vector<std::string> lines;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().filename() == "run.toml" || e.path().filename() == "output.txt") continue;
    std::string line = fs::relative(e.path(), dir).string();
    if (e.path().filename() == "metrics.csv") line += "\n" + fulgur::test::read_bytes(e.path());
    lines.push_back(line);
  }
  std::sort(lines.begin(), lines.end());
  return fmt::format("{}", fmt::join(lines, "\n"));
}

struct Outcome {
  std::string fingerprint;  // trace, weights, steps, metrics, files: all deterministic
  std::string output;       // what the run printed (progress bar, model summary)
  std::string error;        // non-empty when the Trainer refused the configuration
};

// fit, test and predict from `keys`, in a fresh directory, printing into a file.
Outcome run_with(const std::string& keys) {
  TempDir dir;
  Outcome outcome;
  Trace trace;
  const fs::path out_file = dir / "output.txt";
  std::fflush(stdout);
  std::fflush(stderr);
  const int saved_out = ::dup(1), saved_err = ::dup(2);
  const int fd = ::open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 1);
  ::dup2(fd, 2);
  try {
    // default_root_dir: this directory, unless the keys move it (relative to the TOML file).
    const std::string root = keys.find("default_root_dir") == std::string::npos
                                 ? fmt::format("default_root_dir = \"{}\"\n", dir.path().string())
                                 : std::string();
    const std::string text = fmt::format("[trainer]\n{}{}\n", root, keys);
    std::ofstream(dir / "run.toml") << text;
    fulgur::Trainer trainer(fulgur::parse_config(text, dir / "run.toml"));
    ProbeModule module(&trace);  // after the Trainer: its initial weights follow [trainer] seed
    SyntheticData data;
    trainer.fit(module, data);
    const auto tested = trainer.test(module, data);
    const auto predicted = trainer.predict(module, data);
    std::string weights_text;
    for (const auto& [name, w] : weights(module))
      weights_text += fmt::format("{}={:.9g};", name, w.sum().item<double>());
    outcome.fingerprint =
        fmt::format("{}\nweights {}\nstep {} epoch {}\ntest {}\npredicted {}\ntrain loaders {}\nfiles\n{}", show(trace),
                    weights_text, trainer.global_step(), trainer.current_epoch(),
                    tested.empty() ? std::string() : fmt::format("{}", tested[0]), predicted.size(),
                    data.train_loader_calls, files_below(dir.path()));
  } catch (const std::exception& e) {
    outcome.error = e.what();
  }
  std::fflush(stdout);
  std::fflush(stderr);
  ::dup2(saved_out, 1);
  ::dup2(saved_err, 2);
  ::close(saved_out);
  ::close(saved_err);
  ::close(fd);
  outcome.output = fulgur::test::read_bytes(out_file);
  return outcome;
}

struct KeyProbe {
  const char* key;
  std::string value;                    // TOML text, set in the probe run only
  std::string context;                  // more [trainer] lines, set in both runs (what makes the key matter)
  const char* rejected_with = nullptr;  // the refusal names this; else the outcome must differ
  const char* printed = nullptr;        // and, when set, the probe's output contains this
};

}  // namespace

TEST_CASE("every [trainer] key changes what a run does, or its value is rejected: none is silently ignored") {
  // The base: 2 epochs of 4 batches, validation each epoch, CSV logger, nothing printed.
  const std::map<std::string, std::string> base = {{"max_epochs", "2"},
                                                   {"seed", "3"},
                                                   {"enable_progress_bar", "false"},
                                                   {"enable_model_summary", "false"},
                                                   {"enable_checkpointing", "false"},
                                                   {"num_sanity_val_steps", "1"}};
  // [trainer] lines from the base, then `more` ("key = value" lines) on top: TOML refuses a key twice.
  auto keys_with = [&](const std::string& more) {
    std::map<std::string, std::string> keys = base;
    std::istringstream lines(more);
    for (std::string line; std::getline(lines, line);) {
      const size_t eq = line.find(" = ");
      if (eq != std::string::npos) keys[line.substr(0, eq)] = line.substr(eq + 3);
    }
    std::string text;
    for (const auto& [k, v] : keys) text += k + " = " + v + "\n";
    return text;
  };
  const std::vector<KeyProbe> probes = {
      {"accelerator", "\"no_such_accelerator\"", "", "no_such_accelerator"},
      {"strategy", "\"no_such_strategy\"", "", "no_such_strategy"},
      {"precision", "\"64-true\"", ""},
      {"devices", "\"2\"", "", "devices"},
      {"num_nodes", "2", "", "num_nodes"},
      {"max_epochs", "1", ""},
      {"min_epochs", "2", "max_time = \"00:00:00:00\"\n"},
      {"max_steps", "3", ""},
      {"min_steps", "3", "max_time = \"00:00:00:00\"\n"},
      {"max_time", "\"00:00:00:00\"", ""},
      {"limit_train_batches", "2", ""},
      {"limit_val_batches", "1", ""},
      {"limit_test_batches", "1", ""},
      {"limit_predict_batches", "1", ""},
      {"overfit_batches", "1", ""},
      {"val_check_interval", "2", ""},
      {"check_val_every_n_epoch", "2", ""},
      // What it changes needs two ranks: distributed_test.cpp; here, that a non-boolean is refused.
      {"use_distributed_sampler", "\"sometimes\"", "", "use_distributed_sampler"},
      {"reload_dataloaders_every_n_epochs", "1", ""},
      {"num_sanity_val_steps", "0", ""},
      {"log_every_n_steps", "1", ""},
      {"accumulate_grad_batches", "2", ""},
      {"gradient_clip_val", "0.001", ""},
      {"gradient_clip_algorithm", "\"value\"", "gradient_clip_val = 0.001\n"},
      {"deterministic", "true", ""},
      // On the cpu it is refused ("on"); what it does on a capturing device: step_capture_test.cpp.
      {"cuda_graphs", "\"on\"", "", "cuda_graphs = \"on\": the training step cannot be captured"},
      {"seed", "4", ""},
      {"fast_dev_run", "1", ""},
      {"default_root_dir", "\"elsewhere\"", ""},
      // Beside a local root it is refused; what it changes with an s3:// root: storage_test.cpp.
      {"staging_dir", "\"stage\"", "", "staging_dir applies only when default_root_dir is a URL"},
      {"enable_checkpointing", "true", ""},
      {"enable_progress_bar", "true", "", nullptr, "Epoch 0"},
      {"enable_model_summary", "true", "", nullptr, "Total params"},
      {"inference_mode", "false", ""},
      {"detect_anomaly", "true", ""},
      // What it changes needs two ranks and a batch norm: distributed_test.cpp.
      {"sync_batchnorm", "\"yes\"", "", "sync_batchnorm"},
      {"return_predictions", "false", ""},
      {"logger", "false", ""},
      {"barebones", "true", ""},
      {"ckpt_path", "\"no/such/file.ckpt\"", "", "no/such/file.ckpt"},
      // What it changes needs a checkpoint that does not match the model: lightning_checkpoint_test.cpp
      // drives both values through `fulgur fit` in real processes.
      {"strict_loading", "\"no\"", "", "strict_loading"},
      // What they change needs a weights file: user_workflows_test.cpp drives them through `fulgur fit`
      // (each format, the prefix keys, strictness, and a resumed run that keeps its own weights).
      {"init_weights", "\"no/such/weights.pt\"", "", "no/such/weights.pt"},
      {"init_weights_strip_prefix", "1", "", "init_weights_strip_prefix"},
      {"init_weights_add_prefix", "1", "", "init_weights_add_prefix"},
      {"init_weights_strict", "\"no\"", "", "init_weights_strict"},
      // What they change needs a signal: signal_test.cpp drives that in real processes.
      {"interrupt_checkpoint", "\"ckpt/..\"", "", "interrupt_checkpoint"},
      {"requeue_signal", "\"SIGNOPE\"", "", "requeue_signal = \"SIGNOPE\""},
      // What it changes needs checkpoints written in the background: storage_test.cpp drives it
      // through `fulgur fit` (the same files as a synchronous run, a failed save ends the run).
      {"async_checkpoint", "\"yes\"", "", "async_checkpoint"},
  };
  // The walk: a key added to the schema without a probe here fails this test.
  for (const fulgur::OptionSchema& schema : fulgur::trainer_option_schema()) {
    const auto probe =
        std::find_if(probes.begin(), probes.end(), [&](const KeyProbe& p) { return schema.key == p.key; });
    CHECK_MESSAGE(probe != probes.end(), "[trainer] " << std::string(schema.key) << " has no probe in this test");
  }
  CHECK(probes.size() == fulgur::trainer_option_schema().size());

  const Outcome baseline = run_with(keys_with(""));
  REQUIRE_MESSAGE(baseline.error.empty(), baseline.error);
  REQUIRE(run_with(keys_with("")).fingerprint == baseline.fingerprint);  // the comparison means something
  for (const KeyProbe& probe : probes) {
    INFO("[trainer] " << std::string(probe.key) << " = " << probe.value);
    const Outcome reference = probe.context.empty() ? baseline : run_with(keys_with(probe.context));
    const Outcome changed = run_with(keys_with(probe.context + probe.key + " = " + probe.value + "\n"));
    if (probe.rejected_with) {
      CHECK_MESSAGE(!changed.error.empty(), "accepted");
      FULGUR_CHECK_CONTAINS(changed.error, probe.rejected_with);
      continue;
    }
    REQUIRE_MESSAGE(reference.error.empty(), reference.error);
    REQUIRE_MESSAGE(changed.error.empty(), changed.error);
    const bool differs =
        changed.fingerprint != reference.fingerprint || (probe.printed && changed.output != reference.output);
    CHECK_MESSAGE(differs, "the run did the same with and without it");
    if (probe.printed) FULGUR_CHECK_CONTAINS(changed.output, probe.printed);
  }
}

// ---- Lightning semantics (issue #34), each with the test that failed before its fix -------------

namespace {

// Logs "x" from the one hook named `where` (and otherwise behaves as RecordingModule).
struct LogsIn : RecordingModule {
  explicit LogsIn(std::string where) : RecordingModule(nullptr), where(std::move(where)) {}
  void maybe_log(const char* hook) {
    if (where == hook) log("x", 1.0);
  }
  at::Tensor predict_step(const fulgur::Batch& b, int64_t i) override {
    maybe_log("predict_step");
    return RecordingModule::predict_step(b, i);
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    maybe_log("configure_optimizers");
    return RecordingModule::configure_optimizers();
  }
  void on_fit_start() override { maybe_log("on_fit_start"); }
  void on_train_end() override { maybe_log("on_train_end"); }
  void on_train_start() override { maybe_log("on_train_start"); }
  std::string where;
};

// Records the order of setup calls: the DataModule's and the callbacks'.
struct SetupOrderData : SyntheticData {
  explicit SetupOrderData(Trace* trace) : trace(trace) {}
  void setup(fulgur::Stage) override { trace->push_back("D.setup"); }
  Trace* trace;
};

}  // namespace

TEST_CASE(
    "#34.1 log() where Lightning forbids it (predict_step, on_fit_start, configure_optimizers, on_train_end) "
    "raises naming the hook") {
  for (const char* hook : {"predict_step", "on_fit_start", "configure_optimizers", "on_train_end"}) {
    TempDir dir;
    fulgur::Trainer trainer(config_from(dir,
                                        "max_epochs = 1\nlimit_train_batches = 2\nlimit_val_batches = 1\n"
                                        "num_sanity_val_steps = 0\nenable_checkpointing = false\nlogger = false"));
    LogsIn module(hook);
    SyntheticData data;
    std::string error;
    try {
      if (std::string(hook) == "predict_step")
        (void)trainer.predict(module, data);
      else
        trainer.fit(module, data);
    } catch (const std::exception& e) {
      error = e.what();
    }
    INFO(hook << ": " << error);
    CHECK(error.find("log('x')") != std::string::npos);
    CHECK(error.find("not allowed") != std::string::npos);
    CHECK(error.find(hook) != std::string::npos);
  }
  // Where Lightning allows it, it still works.
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 1\nlimit_train_batches = 2\nlimit_val_batches = 1\n"
                                      "enable_checkpointing = false\nlogger = false"));
  LogsIn module("on_train_start");
  SyntheticData data;
  CHECK_NOTHROW(trainer.fit(module, data));
  CHECK(trainer.callback_metrics().contains("x"));
}

TEST_CASE("#34.2 log() in on_train_start and on_train_epoch_start is epoch-level by default, as in Lightning") {
  struct EpochStartLogger : RecordingModule {
    EpochStartLogger() : RecordingModule(nullptr) {}
    void on_train_start() override { log("start/x", 2.0); }
    void on_train_epoch_start() override { log("epoch_start/y", 3.0); }
  };
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 2\nlimit_train_batches = 3\nlimit_val_batches = 1\n"
                                      "log_every_n_steps = 1\nnum_sanity_val_steps = 0\nenable_checkpointing = false",
                                      "[[loggers]]\nname = \"csv\"\n"));
  EpochStartLogger module;
  SyntheticData data;
  trainer.fit(module, data);
  const auto rows = csv_rows(fs::path(trainer.log_dir()) / "metrics.csv");
  int epoch_rows_y = 0, step_rows_y = 0, rows_x = 0;
  for (const auto& row : rows) {
    const bool step_row = row.contains("train/loss");  // training_step's on_step value
    if (row.contains("epoch_start/y")) ++(step_row ? step_rows_y : epoch_rows_y);
    if (row.contains("start/x")) {
      ++rows_x;
      CHECK_FALSE(step_row);
    }
  }
  INFO(fulgur::test::read_bytes(fs::path(trainer.log_dir()) / "metrics.csv"));
  CHECK(step_rows_y == 0);   // before the fix: the first step row of each epoch
  CHECK(epoch_rows_y == 2);  // one epoch-end row per epoch
  CHECK(rows_x == 1);        // the first epoch's end row
}

TEST_CASE("#34.5 limit_train_batches = 0 skips training, as Lightning's fit loop does") {
  TempDir dir;
  Trace trace;
  fulgur::Trainer trainer(config_from(dir,
                                      "limit_train_batches = 0\nlimit_val_batches = 1\n"
                                      "num_sanity_val_steps = 1\nenable_checkpointing = false\nlogger = false"));
  trainer.add_callback(std::make_shared<RecordingCallback>(&trace));
  RecordingModule module(&trace);
  SyntheticData data;
  trainer.fit(module, data);
  CHECK(trainer.current_epoch() == 0);  // before the fix: max_epochs (1000) empty epochs
  CHECK(trainer.global_step() == 0);
  const auto count = [&](const std::string& what) { return std::count(trace.begin(), trace.end(), what); };
  CHECK(count("C.on_sanity_check_start") == 1);  // the sanity check still runs
  CHECK(count("C.on_train_start") == 0);
  CHECK(count("C.on_train_epoch_start") == 0);
  CHECK(count("C.on_validation_start") == 1);  // the sanity check's only
  CHECK(count("C.on_fit_end") == 1);
}

TEST_CASE("#34.7 the DataModule's setup runs before the callbacks' setup, as in Lightning") {
  TempDir dir;
  Trace trace;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 1\nlimit_train_batches = 1\nlimit_val_batches = 1\n"
                                      "num_sanity_val_steps = 0\nenable_checkpointing = false\nlogger = false"));
  trainer.add_callback(std::make_shared<RecordingCallback>(&trace));
  RecordingModule module(nullptr);
  SetupOrderData data(&trace);
  trainer.fit(module, data);
  REQUIRE(trace.size() >= 2);
  CHECK(trace[0] == "D.setup");
  CHECK(trace[1] == "C.setup");
}

TEST_CASE("#34.8 barebones = true runs no sanity check and log() is a no-op, as in Lightning") {
  TempDir dir;
  Trace trace;
  fulgur::Trainer trainer(config_from(dir,
                                      "barebones = true\nmax_epochs = 1\nlimit_train_batches = 2\n"
                                      "limit_val_batches = 1\nenable_checkpointing = false\nlogger = false"));
  RecordingModule module(&trace);
  SyntheticData data;
  trainer.fit(module, data);
  const auto first = [&](const std::string& what) {
    return std::find(trace.begin(), trace.end(), what) - trace.begin();
  };
  // No sanity check: the first validation step comes after training (before the fix: first of all).
  CHECK(first("M.training_step") < first("M.validation_step"));
  CHECK(trainer.callback_metrics().empty());  // nothing logged (RecordingModule logs train/loss and val/*)
}

TEST_CASE("#34.4 manual optimization: global_step counts optimizer steps, no scheduler steps automatically") {
  // A GAN-shaped step: two optimizers, each stepped once per batch, and an epoch StepLR on the first.
  struct TwoOptimizers : RecordingModule {
    TwoOptimizers() : RecordingModule(nullptr) { automatic_optimization = false; }
    fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
      for (size_t i = 0; i < 2; ++i) {
        fulgur::OptimizerHandle opt = optimizer(i);
        opt.zero_grad();
        const at::Tensor loss = torch::nn::functional::cross_entropy(forward(b.input), b.target);
        manual_backward(loss);
        opt.step();
        if (i == 0) log("train/loss", loss);
      }
      return {};
    }
    std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
      first = std::make_shared<torch::optim::SGD>(fc1->parameters(), torch::optim::SGDOptions(0.1));
      auto second = std::make_shared<torch::optim::SGD>(fc2->parameters(), torch::optim::SGDOptions(0.1));
      return {fulgur::OptimizerConfig(first).with_scheduler(fulgur::make_step_lr(*first, 1, 0.5)),
              fulgur::OptimizerConfig(second)};
    }
    std::shared_ptr<torch::optim::SGD> first;
  };
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir,
                                      "max_epochs = 2\nlimit_train_batches = 3\nlimit_val_batches = 1\n"
                                      "log_every_n_steps = 1\nnum_sanity_val_steps = 0\nenable_checkpointing = false",
                                      "[[loggers]]\nname = \"csv\"\n"));
  TwoOptimizers module;
  SyntheticData data;
  trainer.fit(module, data);
  CHECK(trainer.global_step() == 12);  // 2 epochs x 3 batches x 2 optimizer steps (before: 6)
  // The user steps manual schedulers (Lightning steps none): the lr is still the initial one.
  CHECK(module.first->param_groups()[0].options().get_lr() == doctest::Approx(0.1));
  // The loggers' step counts batches, once per batch whatever the number of optimizers.
  std::set<int64_t> steps;
  for (const auto& row : csv_rows(fs::path(trainer.log_dir()) / "metrics.csv"))
    if (row.contains("train/loss")) steps.insert(std::stoll(row.at("step")));
  CHECK(steps == std::set<int64_t>{0, 1, 2, 3, 4, 5});
}

// ---- #34.5 (max_epochs = -1), #34.6, #34.14 and #34.15: Lightning's Trainer flags, each with its
// own effect checked (the schema walk above only checks that a key changes something).

namespace {

// Counts what a run did, by hook: validation runs outside the sanity check, optimizer steps,
// sanity-check validation steps.
struct FlagCounter : fulgur::Callback {
  fulgur::HookSet hooks() const override { return ~fulgur::HookSet{0}; }
  void on_sanity_check_start(fulgur::TrainerContext&) override { sanity = true; }
  void on_sanity_check_end(fulgur::TrainerContext&) override { sanity = false; }
  void on_validation_start(fulgur::TrainerContext& t) override {
    if (!sanity) validations.push_back(t.global_step());
  }
  void on_validation_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&,
                               int64_t) override {
    if (sanity) ++sanity_batches;
  }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&, int64_t) override {
    ++train_batches;
  }
  void on_before_optimizer_step(fulgur::TrainerContext&, torch::optim::Optimizer&) override { ++optimizer_steps; }
  void on_train_start(fulgur::TrainerContext&) override {
    deterministic = at::globalContext().deterministicAlgorithms();
    warn_only = at::globalContext().deterministicAlgorithmsWarnOnly();
  }
  bool sanity = false, deterministic = false, warn_only = false;
  std::vector<int64_t> validations;  // global_step at each validation's start
  int sanity_batches = 0, train_batches = 0, optimizer_steps = 0;
};

struct FlagRun {
  std::shared_ptr<TempDir> dir = std::make_shared<TempDir>();  // the run's files live as long as this
  std::shared_ptr<FlagCounter> counter = std::make_shared<FlagCounter>();
  int64_t epochs = 0, steps = 0;
  std::string log_dir;
};

FlagRun run_flags(const std::string& trainer_keys, fulgur::Module* module = nullptr, const std::string& extra = "") {
  FlagRun run;
  fulgur::Trainer trainer(config_from(*run.dir, trainer_keys + "\nenable_checkpointing = false", extra));
  trainer.add_callback(run.counter);
  RecordingModule recording(nullptr);
  SyntheticData data(96, 16);  // 6 training batches
  trainer.fit(module ? *module : recording, data);
  run.epochs = trainer.current_epoch();
  run.steps = trainer.global_step();
  run.log_dir = trainer.log_dir();
  return run;
}

// Stops the run once `epoch` epochs are done: "another limit" than max_epochs.
struct StopAfterEpochs : fulgur::Callback {
  explicit StopAfterEpochs(int64_t epochs) : epochs(epochs) {}
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::train_epoch_end); }
  void on_train_epoch_end(fulgur::TrainerContext& t) override {
    if (t.current_epoch() + 1 >= epochs) t.request_stop("enough epochs");
  }
  int64_t epochs;
};

}  // namespace

TEST_CASE(
    "#34.5 max_epochs = -1 trains until another limit, and unset it is 1000 epochs, and the saved config says so") {
  const std::string tiny =
      "limit_train_batches = 1\nlimit_val_batches = 0\nnum_sanity_val_steps = 0\n"
      "enable_checkpointing = false\nlogger = false\n";
  {
    TempDir dir;
    fulgur::Trainer trainer(config_from(dir, "max_epochs = -1\n" + tiny));
    trainer.add_callback(std::make_shared<StopAfterEpochs>(1003));
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data);
    CHECK(trainer.current_epoch() == 1003);  // before: 1000 (-1 was read as "unset")
  }
  {
    TempDir dir;
    const fulgur::Config config = config_from(dir, tiny);
    CHECK(config.trainer.get_int("max_epochs") == 1000);
    FULGUR_CHECK_CONTAINS(fulgur::to_toml(config), "max_epochs = 1000");
    fulgur::Trainer trainer(config);
    RecordingModule module(nullptr);
    SyntheticData data;
    trainer.fit(module, data);
    CHECK(trainer.current_epoch() == 1000);
  }
  // Unset with max_steps given: no epoch limit (Lightning's max_epochs = None with max_steps).
  TempDir dir;
  const fulgur::Config steps = config_from(dir, "max_steps = 1200\n" + tiny);
  CHECK(steps.trainer.get_int("max_epochs") == -1);
  FULGUR_CHECK_CONTAINS(fulgur::to_toml(steps), "max_epochs = -1");
  fulgur::ConfigBuilder builder;
  builder.max_steps(5);
  CHECK(builder.to_config().trainer.get_int("max_epochs") == -1);
  builder.max_epochs(3).max_steps(7);
  CHECK(builder.to_config().trainer.get_int("max_epochs") == 3);  // given: kept
}

TEST_CASE("#34.6 overfit_batches trains on the same batches every epoch and validates on exactly those") {
  // The batches' contents, as the sum of each input, by stage and epoch.
  struct Fingerprints : RecordingModule {
    Fingerprints() : RecordingModule(nullptr) {}
    fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t i) override {
      train[current_epoch].insert(b.input.sum().item<double>());
      return RecordingModule::training_step(b, i);
    }
    fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t i) override {
      val[current_epoch].insert(b.input.sum().item<double>());
      return RecordingModule::validation_step(b, i);
    }
    void on_train_epoch_start() override { ++current_epoch; }
    int64_t current_epoch = -1;
    std::map<int64_t, std::set<double>> train, val;
  };
  Fingerprints module;
  run_flags("max_epochs = 3\noverfit_batches = 2\nnum_sanity_val_steps = 0\nlogger = false", &module);
  REQUIRE(module.train.size() == 3);
  CHECK(module.train.at(0).size() == 2);
  CHECK(module.train.at(1) == module.train.at(0));  // before: each epoch shuffled anew
  CHECK(module.train.at(2) == module.train.at(0));
  for (const auto& [epoch, batches] : module.val) CHECK(batches == module.train.at(0));
}

TEST_CASE(
    "#34.14 num_sanity_val_steps, val_check_interval, check_val_every_n_epoch and accumulate_grad_batches "
    "have Lightning's effect") {
  // 6 training batches per epoch, 6 validation batches.
  CHECK(run_flags("max_epochs = 1\nnum_sanity_val_steps = 3\nlogger = false").counter->sanity_batches == 3);
  CHECK(run_flags("max_epochs = 1\nnum_sanity_val_steps = -1\nlogger = false").counter->sanity_batches == 6);
  // Every 2 batches, the last one being the epoch's own: after steps 2, 4 and 6.
  CHECK(run_flags("max_epochs = 1\nval_check_interval = 2\nlogger = false").counter->validations ==
        std::vector<int64_t>{2, 4, 6});
  CHECK(run_flags("max_epochs = 1\nval_check_interval = 0.5\nlogger = false").counter->validations ==
        std::vector<int64_t>{3, 6});
  // Epochs 2 and 4 of 4.
  CHECK(run_flags("max_epochs = 4\ncheck_val_every_n_epoch = 2\nlogger = false").counter->validations ==
        std::vector<int64_t>{12, 24});
  const FlagRun accumulated = run_flags("max_epochs = 1\naccumulate_grad_batches = 3\nlogger = false");
  CHECK(accumulated.steps == 2);
  CHECK(accumulated.counter->optimizer_steps == 2);
  CHECK(accumulated.counter->train_batches == 6);
}

TEST_CASE("#34.14 log_every_n_steps sends every Nth step's values to the loggers") {
  const FlagRun run = run_flags("max_epochs = 1\nlog_every_n_steps = 2\nlimit_val_batches = 0", nullptr,
                                "[[loggers]]\nname = \"csv\"\n");
  std::vector<int64_t> steps;
  for (const auto& row : csv_rows(fs::path(run.log_dir) / "metrics.csv"))
    if (row.contains("train/loss") && !row.at("train/loss").empty()) steps.push_back(std::stoll(row.at("step")));
  CHECK(steps == std::vector<int64_t>{1, 3, 5});  // Lightning: (batches_that_stepped + 1) % N == 0
}

TEST_CASE("#34.14 gradient_clip_val clips the gradients the optimizer steps with, by norm or by value") {
  // The gradients as the optimizer sees them, after clipping (on_before_zero_grad follows the step).
  struct GradientProbe : fulgur::Callback {
    fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::before_zero_grad); }
    void on_before_zero_grad(fulgur::TrainerContext&, torch::optim::Optimizer& optimizer) override {
      double squares = 0, largest = 0;
      for (const auto& group : optimizer.param_groups())
        for (const auto& p : group.params())
          if (p.grad().defined()) {
            squares += p.grad().pow(2).sum().item<double>();
            largest = std::max(largest, p.grad().abs().max().item<double>());
          }
      norms.push_back(std::sqrt(squares));
      maxima.push_back(largest);
    }
    std::vector<double> norms, maxima;
  };
  auto run = [](const std::string& keys) {
    TempDir dir;
    fulgur::Trainer trainer(config_from(dir,
                                        "max_epochs = 1\nlimit_val_batches = 0\nlogger = false\n"
                                        "enable_checkpointing = false\n" +
                                            keys));
    auto probe = std::make_shared<GradientProbe>();
    trainer.add_callback(probe);
    RecordingModule module(nullptr);
    SyntheticData data(96, 16);
    trainer.fit(module, data);
    return probe;
  };
  // Lightning's order: on_before_zero_grad runs before each backward, so it sees the gradients the
  // previous batch's step used (none before the first).
  const auto free = run("");
  REQUIRE(free->norms.size() == 6);
  CHECK(free->norms.front() == 0);
  CHECK(*std::min_element(free->norms.begin() + 1, free->norms.end()) > 0.05);  // clipping has work to do
  CHECK(*std::max_element(free->maxima.begin(), free->maxima.end()) > 0.01);
  const auto by_norm = run("gradient_clip_val = 0.05\n");
  for (size_t i = 1; i < by_norm->norms.size(); ++i) CHECK(by_norm->norms[i] == doctest::Approx(0.05).epsilon(1e-4));
  const auto by_value = run("gradient_clip_val = 0.01\ngradient_clip_algorithm = \"value\"\n");
  for (size_t i = 1; i < by_value->maxima.size(); ++i) {
    CHECK(by_value->maxima[i] <= 0.01 + 1e-7);
    CHECK(by_value->norms[i] < free->norms[i]);
  }
}

TEST_CASE("#34.14/#34.15 deterministic = true and \"warn\" switch torch's deterministic algorithms on, as Lightning") {
  const FlagRun on = run_flags("max_epochs = 1\nlimit_train_batches = 1\nlogger = false\ndeterministic = true");
  CHECK(on.counter->deterministic);
  CHECK_FALSE(on.counter->warn_only);
  const FlagRun warn = run_flags("max_epochs = 1\nlimit_train_batches = 1\nlogger = false\ndeterministic = \"warn\"");
  CHECK(warn.counter->deterministic);
  CHECK(warn.counter->warn_only);
  at::globalContext().setDeterministicAlgorithms(false, false);  // this process runs other tests after
  TempDir dir;
  const fulgur::Error bad =
      fulgur::test::error_from([&] { fulgur::Trainer trainer(config_from(dir, "deterministic = \"sometimes\"")); });
  FULGUR_CHECK_CONTAINS(bad.what(), "deterministic = \"sometimes\": use true, false or \"warn\"");
}

TEST_CASE("#34.14 detect_anomaly = true names the backward function that produced NaN") {
  struct NanGradient : RecordingModule {
    NanGradient() : RecordingModule(nullptr) {}
    fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
      // sqrt at 0: its backward divides by zero, 0 * inf = NaN.
      return {(forward(b.input) * 0).sqrt().sum()};
    }
  };
  NanGradient quiet;
  CHECK_NOTHROW(run_flags("max_epochs = 1\nlimit_train_batches = 1\nlogger = false", &quiet));
  NanGradient loud;
  std::string error;
  try {
    run_flags("max_epochs = 1\nlimit_train_batches = 1\nlogger = false\ndetect_anomaly = true", &loud);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // The first backward function whose output is NaN: sqrt's inf gradient times the zero factor.
  FULGUR_CHECK_CONTAINS(error, "Function 'MulBackward1' returned nan values");
}

TEST_CASE("#34.15 check_val_every_n_epoch = \"none\" counts val_check_interval batches across epochs") {
  // 6 batches per epoch, validation every 4 batches counted over the run: after steps 4, 8 and 12.
  CHECK(run_flags("max_epochs = 2\ncheck_val_every_n_epoch = \"none\"\nval_check_interval = 4\nlogger = false")
            .counter->validations == std::vector<int64_t>{4, 8, 12});
  CHECK(run_flags("max_epochs = 2\ncheck_val_every_n_epoch = 0\nval_check_interval = 4\nlogger = false")
            .counter->validations == std::vector<int64_t>{4, 8, 12});
  TempDir dir;
  const fulgur::Error fraction = fulgur::test::error_from([&] {
    fulgur::Trainer trainer(config_from(dir, "check_val_every_n_epoch = \"none\"\nval_check_interval = 0.5"));
  });
  FULGUR_CHECK_CONTAINS(fraction.what(), "must be a number of batches");
}

TEST_CASE("#34.15 a wall-clock val_check_interval validates after the batch that ends the interval") {
  // Each training step takes at least 1.05 s: with a 1-second interval every batch is due; with
  // ten hours none is, not even the epoch's last (Lightning's time-based validation).
  struct SlowSteps : RecordingModule {
    SlowSteps() : RecordingModule(nullptr) {}
    fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t i) override {
      std::this_thread::sleep_for(std::chrono::milliseconds(1050));
      return RecordingModule::training_step(b, i);
    }
  };
  SlowSteps every;
  CHECK(run_flags("max_epochs = 1\nlimit_train_batches = 3\nval_check_interval = \"1\"\nlogger = false", &every)
            .counter->validations == std::vector<int64_t>{1, 2, 3});
  SlowSteps none;
  CHECK(run_flags("max_epochs = 1\nlimit_train_batches = 2\nval_check_interval = \"10:00:00\"\nlogger = false", &none)
            .counter->validations.empty());
  TempDir dir;
  const fulgur::Error bad =
      fulgur::test::error_from([&] { fulgur::Trainer trainer(config_from(dir, "val_check_interval = \"soon\"")); });
  FULGUR_CHECK_CONTAINS(bad.what(), "val_check_interval = \"soon\": a wall-clock interval is \"DD:HH:MM:SS\"");
}

TEST_CASE("#34.15 fast_dev_run = true, precision 16 / \"bf16\" / 32 and accelerator = \"gpu\" are Lightning's") {
  TempDir dir;
  const FlagRun fast = run_flags("fast_dev_run = true\nlogger = false");
  CHECK(fast.steps == 1);
  CHECK(fast.counter->train_batches == 1);
  for (const auto& [spelled, plugin] :
       std::vector<std::pair<std::string, std::string>>{{"16", "16-mixed"},
                                                        {"\"16\"", "16-mixed"},
                                                        {"\"bf16\"", "bf16-mixed"},
                                                        {"32", "32-true"},
                                                        {"\"64\"", "64-true"},
                                                        {"\"bf16-true\"", "bf16-true"}}) {
    CAPTURE(spelled);
    CHECK(config_from(dir, "precision = " + spelled).precision.name == plugin);
  }
  CHECK(config_from(dir, "precision = \"bf16\"", "[precision]\nname = \"bf16-mixed\"\n").precision.name ==
        "bf16-mixed");
  fulgur::ConfigBuilder builder;
  builder.precision("bf16").fast_dev_run(true).deterministic("warn");
  CHECK(builder.to_config().precision.name == "bf16-mixed");
  CHECK(builder.to_config().trainer.get_int("fast_dev_run") == 1);
  CHECK(builder.to_config().trainer.get_string("deterministic") == "warn");
  // "gpu" picks among the accelerators that are not the cpu; on a machine without a GPU it says so.
  try {
    fulgur::Trainer trainer(config_from(dir, "accelerator = \"gpu\""));
    CHECK(trainer.config().accelerator.name != "cpu");  // a machine with a GPU
  } catch (const fulgur::Error& e) {
    FULGUR_CHECK_CONTAINS(e.what(), "accelerator = \"gpu\" found no available GPU accelerator");
    FULGUR_CHECK_CONTAINS(e.what(), "on a machine without a GPU, use accelerator = \"auto\"");
  }
}
