// The Trainer end to end with the built-in plugins: Lightning's hook order for fit (with sanity
// check and validation), validate, test, predict and resume; exact resume; checkpoints that
// Python opens; bad checkpoints and paths that fail clearly.
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <ATen/core/ivalue.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdlib>
#include <fstream>

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

// Writes a full checkpoint from inside the loop when global_step reaches `step` (what
// model_checkpoint's every_n_train_steps does), so it records the mid-epoch position.
struct SaveAtStep : fulgur::Callback {
  SaveAtStep(int64_t step, std::string path) : step(step), path(std::move(path)) {}
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_end); }
  void on_train_batch_end(fulgur::TrainerContext& t, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    if (t.global_step() == step) t.save_checkpoint(path, false);
  }
  int64_t step;
  std::string path;
};

// 3-class synthetic data: deterministic, small, learnable.
struct SyntheticData : fulgur::DataModule {
  explicit SyntheticData(int64_t n = 64, int64_t batch = 16) : batch(batch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    x = at::randn({n, 8}, gen);
    y = (x.slice(1, 0, 1).squeeze(1) > 0).to(at::kLong) + (x.slice(1, 1, 2).squeeze(1) > 0.5).to(at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch).shuffle(true).seed(7));
  }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch));
  }
  std::unique_ptr<fulgur::BatchLoader> test_loader() override { return val_loader(); }
  std::unique_ptr<fulgur::BatchLoader> predict_loader() override { return val_loader(); }
  int64_t batch;
  at::Tensor x, y;
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
  const std::string command = fmt::format("{} {} {} 2>&1", FULGUR_TEST_PYTHON, script.string(), ckpt.string());
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe)) output += buffer;
  const int status = ::pclose(pipe);
  INFO(output);
  CHECK(status == 0);
  CHECK(output.find("python-ok") != std::string::npos);
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
    try {
      trainer.fit(module, data, "last");
      FAIL("expected an error");
    } catch (const fulgur::Error& e) {
      CHECK(e.kind() == fulgur::ErrorKind::checkpoint);
      CHECK(std::string(e.what()).find("last") != std::string::npos);
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
