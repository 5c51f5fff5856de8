// The built-in precisions beyond 32-true, loaded through the registry as the Trainer loads them:
// bf16-mixed (autocast scope), 16-mixed (loss scaler: skip on inf, backoff, growth, state,
// clipping on unscaled gradients), 64-true / bf16-true / 16-true (dtype conversion and the
// setup-time kernel check), short end-to-end fits through the Trainer, and manual optimization
// stepping through the precision plugin (OptimizerHandle).
#include "test_support.h"

#include "../plugins/precision/common/dtype_check.h"

#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/module.h>
#include <fulgur/precision.h>
#include <fulgur/registry/registry.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DefaultDtype.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <set>

namespace fulgur {
namespace {

using test::error_from;
using test::TempDir;

PluginRegistry& registry() {
  static PluginRegistry instance(plugin_search_path({}));
  return instance;
}

// Every schema default, then `overrides` (as the config loader does).
Options options_for(std::string_view name, const std::map<std::string, OptionValue>& overrides = {}) {
  Options options(fmt::format("precision '{}'", name));
  for (const OptionSchema& schema : registry().resolve(PluginKind::precision, name).metadata.options) {
    REQUIRE_MESSAGE(schema.default_value.has_value(), "option without default: " << schema.key);
    options.set(schema.key, *schema.default_value);
  }
  for (const auto& [key, value] : overrides) {
    REQUIRE_MESSAGE(registry().resolve(PluginKind::precision, name).metadata.find_option(key) != nullptr,
                    "no option " << key);
    options.set(key, value);
  }
  return options;
}

std::shared_ptr<Precision> precision(std::string_view name, const std::map<std::string, OptionValue>& overrides = {}) {
  return plugin_cast<Precision>(registry().create(PluginKind::precision, name, options_for(name, overrides)));
}

double scale_of(Precision& p) {
  c10::IValue state;
  p.state_dict(state);
  REQUIRE(state.isGenericDict());
  return state.toGenericDict().at("scale").toDouble();
}

int64_t tracker_of(Precision& p) {
  c10::IValue state;
  p.state_dict(state);
  return state.toGenericDict().at("growth_tracker").toInt();
}

std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// Equal up to rounding: the Trainer steps Adam with ATen's fused kernel where 16-mixed decides on
// the device, manual optimization with libtorch's Adam::step().
bool close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::allclose(a[i], b[i], 1e-5, 1e-7)) return false;
  return true;
}

// A Linear of the same shape and weights (drawing its own initial weights first, as a second
// Linear would): the unscaled float32 reference of a test.
torch::nn::Linear copy_of(const torch::nn::Linear& model) {
  torch::nn::Linear copy(model->options);
  torch::NoGradGuard no_grad;
  copy->weight.copy_(model->weight);
  copy->bias.copy_(model->bias);
  return copy;
}

// One fp32 backward of the scaled loss (no autocast, so gradients are exact multiples).
void scaled_backward(Precision& p, torch::nn::Linear& model, const at::Tensor& x) {
  at::Tensor loss = model->forward(x).pow(2).mean();
  p.scale_loss(loss).backward();
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// bf16-mixed

TEST_CASE("bf16-mixed: bf16 compute inside the scope, fp32 outside, fp32 weights, state restored") {
  auto p = precision("bf16-mixed");
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 3);
  p->convert_module(*linear);
  CHECK((linear->weight.scalar_type() == at::kFloat));
  const at::Tensor x = torch::randn({2, 4});
  fulgur::Batch batch{x, torch::tensor({0, 1})};
  p->convert_input(batch);
  CHECK((batch.input.scalar_type() == at::kFloat));

  REQUIRE_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  const at::ScalarType dtype_before = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
  {
    PrecisionScope scope(*p);
    CHECK(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
    CHECK((linear->forward(x).scalar_type() == at::kBFloat16));
    {
      PrecisionScope inner(*p);  // nested scopes leave the outer one intact
      CHECK((linear->forward(x).scalar_type() == at::kBFloat16));
    }
    CHECK(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
    CHECK((linear->forward(x).scalar_type() == at::kBFloat16));
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  CHECK((at::autocast::get_autocast_dtype(c10::DeviceType::CPU) == dtype_before));
  CHECK((linear->forward(x).scalar_type() == at::kFloat));
  CHECK((linear->weight.scalar_type() == at::kFloat));

  // Backward through the bf16 forward gives fp32 gradients; the optimizer steps fp32 weights.
  torch::optim::SGD sgd(linear->parameters(), torch::optim::SGDOptions(0.1));
  at::Tensor loss;
  {
    PrecisionScope scope(*p);
    loss = linear->forward(x).pow(2).mean();
  }
  p->scale_loss(loss).backward();
  CHECK((linear->weight.grad().scalar_type() == at::kFloat));
  p->unscale_gradients(sgd);
  CHECK(p->optimizer_step(sgd));
  CHECK((linear->weight.scalar_type() == at::kFloat));

  c10::IValue state;
  p->state_dict(state);
  CHECK(state.isGenericDict());
  CHECK(state.toGenericDict().empty());
  p->load_state_dict(state);
}

// ----------------------------------------------------------------------------------------------
// 16-mixed

TEST_CASE("16-mixed: scaled loss, unscale once, skip on inf, back off, grow after growth_interval") {
  auto p = precision("16-mixed", {{"init_scale", 1024.0}, {"growth_interval", int64_t{3}}});
  torch::manual_seed(1);
  torch::nn::Linear model(4, 2);
  torch::nn::Linear reference = copy_of(model);
  p->convert_module(*model);  // CPU: warns and autocasts to bf16 in the scope
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  const at::Tensor x = torch::randn({8, 4});
  CHECK(scale_of(*p) == 1024.0);
  CHECK(tracker_of(*p) == 0);

  // The loss is multiplied by the scale; unscaling recovers the true gradients, once.
  const at::Tensor loss = model->forward(x).pow(2).mean();
  CHECK(p->scale_loss(loss).item<double>() == doctest::Approx(loss.item<double>() * 1024.0));
  sgd.zero_grad();
  scaled_backward(*p, model, x);
  reference->zero_grad();
  reference->forward(x).pow(2).mean().backward();
  CHECK(torch::allclose(model->weight.grad(), reference->weight.grad() * 1024.0));
  p->unscale_gradients(sgd);
  CHECK(torch::allclose(model->weight.grad(), reference->weight.grad()));
  p->unscale_gradients(sgd);  // idempotent within a step
  CHECK(torch::allclose(model->weight.grad(), reference->weight.grad()));
  std::vector<at::Tensor> before = snapshot(*model);
  CHECK(p->optimizer_step(sgd));
  CHECK_FALSE(same(before, snapshot(*model)));
  CHECK(scale_of(*p) == 1024.0);
  CHECK(tracker_of(*p) == 1);

  // Injected inf: the step is skipped, parameters unchanged, the scale halves, the tracker resets.
  for (const at::Tensor& bad : {torch::tensor(std::numeric_limits<float>::infinity()),
                                torch::tensor(std::numeric_limits<float>::quiet_NaN())}) {
    sgd.zero_grad();
    scaled_backward(*p, model, x);
    {
      torch::NoGradGuard no_grad;
      model->bias.grad()[0] = bad;
    }
    before = snapshot(*model);
    const double scale = scale_of(*p);
    CHECK_FALSE(p->optimizer_step(sgd));  // unscales itself when the Trainer did not
    CHECK(same(before, snapshot(*model)));
    CHECK(scale_of(*p) == scale * 0.5);
    CHECK(tracker_of(*p) == 0);
  }
  CHECK(scale_of(*p) == 256.0);

  // growth_interval (3) good steps in a row double it again.
  for (int step = 1; step <= 3; ++step) {
    sgd.zero_grad();
    scaled_backward(*p, model, x);
    p->unscale_gradients(sgd);
    CHECK(p->optimizer_step(sgd));
    CHECK(scale_of(*p) == (step < 3 ? 256.0 : 512.0));
    CHECK(tracker_of(*p) == (step < 3 ? step : 0));
  }
}

TEST_CASE("16-mixed: the device decision: found_inf after unscale, the scale updated on it, an abandoned step") {
  auto p = precision("16-mixed", {{"init_scale", 1024.0}});
  auto* device_step = fulgur::find_extension<fulgur::DeviceStepPrecision>(*p);
  REQUIRE(device_step != nullptr);
  torch::manual_seed(2);
  torch::nn::Linear model(4, 2);
  torch::nn::Linear reference = copy_of(model);
  p->convert_module(*model);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  const at::Tensor x = torch::randn({8, 4});
  reference->forward(x).pow(2).mean().backward();
  auto scaled_grads = [&] {
    adam.zero_grad();
    scaled_backward(*p, model, x);
    CHECK(torch::allclose(model->weight.grad(), reference->weight.grad() * scale_of(*p)));
  };

  // Finite gradients: unscaled by the call, flag 0, the scale kept (growth_interval 2000).
  scaled_grads();
  const at::Tensor found = device_step->device_found_inf(adam);
  REQUIRE(found.defined());
  CHECK(found.dim() == 0);
  CHECK((found.scalar_type() == at::kFloat));
  CHECK(found.item<float>() == 0.0f);
  CHECK(torch::allclose(model->weight.grad(), reference->weight.grad()));
  CHECK(device_step->device_found_inf(adam).is_same(found));  // the same step: no second unscale
  device_step->update_after_device_step(adam, found);
  CHECK(scale_of(*p) == 1024.0);
  CHECK(tracker_of(*p) == 1);

  // An inf: flag 1 (exactly: the fused kernels skip on 1.0), the scale halves on the device.
  scaled_grads();
  {
    torch::NoGradGuard no_grad;
    model->bias.grad()[0] = std::numeric_limits<float>::infinity();
  }
  const at::Tensor bad = device_step->device_found_inf(adam);
  CHECK(bad.item<float>() == 1.0f);
  device_step->update_after_device_step(adam, bad);
  CHECK(scale_of(*p) == 512.0);
  CHECK(tracker_of(*p) == 0);

  // A step abandoned after its unscale (a failed capture) changes nothing, and the next step's
  // gradients are unscaled again instead of being taken for done.
  scaled_grads();
  device_step->device_found_inf(adam);
  device_step->update_after_device_step(adam, at::Tensor());
  CHECK(scale_of(*p) == 512.0);
  CHECK(tracker_of(*p) == 0);
  scaled_grads();
  CHECK(device_step->device_found_inf(adam).item<float>() == 0.0f);
  CHECK(torch::allclose(model->weight.grad(), reference->weight.grad()));
  // And one left behind by a fit that failed mid-step is forgotten when the next fit converts
  // the model.
  p->convert_module(*model);
  scaled_grads();
  p->unscale_gradients(adam);
  CHECK(torch::allclose(model->weight.grad(), reference->weight.grad()));
}

TEST_CASE("16-mixed: sparse gradients are unscaled and checked through their values") {
  auto p = precision("16-mixed", {{"init_scale", 256.0}});
  auto* device_step = fulgur::find_extension<fulgur::DeviceStepPrecision>(*p);
  REQUIRE(device_step != nullptr);
  torch::manual_seed(3);
  torch::nn::Embedding table(torch::nn::EmbeddingOptions(10, 3).sparse(true));
  p->convert_module(*table);
  torch::optim::Adam adam(table->parameters(), torch::optim::AdamOptions(0.1));
  const at::Tensor ids = torch::tensor({1, 2, 2, 7});
  auto backward = [&] {
    adam.zero_grad();
    p->scale_loss(table->forward(ids).pow(2).sum()).backward();
    REQUIRE(table->weight.grad().is_sparse());
  };
  // d/dw sum(w[i]^2) = 2 w[i] per occurrence: row 2 twice.
  at::Tensor expected = torch::zeros({10, 3});
  for (int64_t i : {1, 2, 2, 7}) expected[i] += 2 * table->weight.detach()[i];
  backward();
  CHECK(device_step->device_found_inf(adam).item<float>() == 0.0f);
  CHECK(torch::allclose(table->weight.grad().to_dense(), expected));
  device_step->update_after_device_step(adam, device_step->device_found_inf(adam));
  backward();
  {
    torch::NoGradGuard no_grad;
    table->weight.grad()._values()[0][0] = std::numeric_limits<float>::quiet_NaN();
  }
  CHECK(device_step->device_found_inf(adam).item<float>() == 1.0f);
}

TEST_CASE("16-mixed: state_dict / load_state_dict round-trip restores the scale") {
  auto p = precision("16-mixed", {{"init_scale", 64.0}});
  torch::nn::Linear model(3, 1);
  p->convert_module(*model);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  const at::Tensor x = torch::randn({4, 3});
  scaled_backward(*p, model, x);
  {
    torch::NoGradGuard no_grad;
    model->weight.grad().fill_(std::numeric_limits<float>::infinity());
  }
  CHECK_FALSE(p->optimizer_step(sgd));
  sgd.zero_grad();
  scaled_backward(*p, model, x);
  CHECK(p->optimizer_step(sgd));
  c10::IValue state;
  p->state_dict(state);
  REQUIRE(state.isGenericDict());
  CHECK(state.toGenericDict().at("scale").toDouble() == 32.0);
  CHECK(state.toGenericDict().at("growth_tracker").toInt() == 1);

  auto fresh = precision("16-mixed");
  CHECK(scale_of(*fresh) == 65536.0);
  fresh->load_state_dict(state);
  CHECK(scale_of(*fresh) == 32.0);
  CHECK(tracker_of(*fresh) == 1);
  const at::Tensor loss = torch::tensor(2.0f);
  CHECK(fresh->scale_loss(loss).item<double>() == 64.0);

  // A checkpoint without scaler state (32-true) keeps the scale; malformed state fails clearly.
  fresh->load_state_dict(c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  CHECK(scale_of(*fresh) == 32.0);
  c10::impl::GenericDict bad(c10::StringType::get(), c10::AnyType::get());
  bad.insert("scale", std::string("big"));
  bad.insert("growth_tracker", int64_t{0});
  CHECK(error_from([&] { fresh->load_state_dict(bad); }).kind() == ErrorKind::checkpoint);
  CHECK(error_from([&] { fresh->load_state_dict(c10::IValue(int64_t{3})); }).kind() == ErrorKind::checkpoint);
  CHECK(scale_of(*fresh) == 32.0);
}

TEST_CASE("16-mixed: clipping acts on unscaled gradients, like clip_grad_norm_/clip_grad_value_") {
  for (GradClipAlgorithm algorithm : {GradClipAlgorithm::norm, GradClipAlgorithm::value}) {
    for (bool trainer_unscales : {true, false}) {
      CAPTURE(static_cast<int>(algorithm));
      CAPTURE(trainer_unscales);
      auto p = precision("16-mixed", {{"init_scale", 4096.0}});
      torch::manual_seed(2);
      torch::nn::Linear model(5, 3);
      torch::nn::Linear reference = copy_of(model);
      p->convert_module(*model);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
      const at::Tensor x = torch::randn({6, 5}) * 10;
      scaled_backward(*p, model, x);
      reference->forward(x).pow(2).mean().backward();
      if (trainer_unscales) p->unscale_gradients(sgd);
      const double clip = algorithm == GradClipAlgorithm::norm ? 0.5 : 0.05;
      p->clip_gradients(sgd, clip, algorithm);
      if (algorithm == GradClipAlgorithm::norm)
        torch::nn::utils::clip_grad_norm_(reference->parameters(), clip);
      else
        torch::nn::utils::clip_grad_value_(reference->parameters(), clip);
      CHECK(torch::allclose(model->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
      CHECK(torch::allclose(model->bias.grad(), reference->bias.grad(), 1e-5, 1e-6));
      p->unscale_gradients(sgd);  // the Trainer's call after clipping changes nothing
      CHECK(torch::allclose(model->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
      CHECK(p->optimizer_step(sgd));
    }
  }
}

TEST_CASE("16-mixed: bad scaler options are config errors") {
  const std::vector<std::pair<std::string, OptionValue>> bad = {
      {"init_scale", 0.0}, {"growth_factor", 0.5}, {"backoff_factor", 1.5}, {"growth_interval", int64_t{0}}};
  for (const auto& [key, value] : bad) {
    CAPTURE(key);
    const Error e = error_from([&] { precision("16-mixed", {{key, value}}); });
    FULGUR_CHECK_CONTAINS(e.what(), key);
  }
}

TEST_CASE("16-mixed on CPU autocasts to bf16 in the scope") {
  auto p = precision("16-mixed");
  torch::nn::Linear linear(4, 3);
  p->convert_module(*linear);
  const at::Tensor x = torch::randn({2, 4});
  {
    PrecisionScope scope(*p);
    CHECK((linear->forward(x).scalar_type() == at::kBFloat16));
  }
  CHECK((linear->forward(x).scalar_type() == at::kFloat));
  CHECK((linear->weight.scalar_type() == at::kFloat));
}

// ----------------------------------------------------------------------------------------------
// 64-true, bf16-true, 16-true

TEST_CASE("64-true: float64 parameters and floating buffers, converted inputs, float64 default in forward") {
  auto p = precision("64-true");
  torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));  // built before conversion
  p->convert_module(*model);
  for (const at::Tensor& param : model->parameters()) CHECK((param.scalar_type() == at::kDouble));
  for (const auto& buffer : model->named_buffers()) {
    CAPTURE(buffer.key());
    const bool counter = buffer.key().find("num_batches_tracked") != std::string::npos;
    CHECK((buffer.value().scalar_type() == (counter ? at::kLong : at::kDouble)));
  }
  Batch batch{torch::randn({5, 4}), torch::tensor({0, 1, 2, 0, 1}), {torch::rand({5}), torch::arange(5)}};
  p->convert_input(batch);
  CHECK((batch.input.scalar_type() == at::kDouble));
  CHECK((batch.target.scalar_type() == at::kLong));
  CHECK((batch.extra[0].scalar_type() == at::kDouble));
  CHECK((batch.extra[1].scalar_type() == at::kLong));
  at::Tensor out;
  {
    PrecisionScope scope(*p);
    CHECK((torch::ones({2}).scalar_type() == at::kDouble));
    out = model->forward(batch.input);
  }
  CHECK((torch::ones({2}).scalar_type() == at::kFloat));
  CHECK((out.scalar_type() == at::kDouble));
  p->scale_loss(out.pow(2).mean()).backward();
  p->unscale_gradients(sgd);
  p->clip_gradients(sgd, 0.1, GradClipAlgorithm::norm);
  CHECK(p->optimizer_step(sgd));  // the optimizer built before conversion steps the double params
  for (const at::Tensor& param : model->parameters()) CHECK((param.scalar_type() == at::kDouble));
}

TEST_CASE("bf16-true and 16-true convert parameters and inputs") {
  for (const auto& [name, dtype] : {std::pair<std::string, at::ScalarType>{"bf16-true", at::kBFloat16},
                                    std::pair<std::string, at::ScalarType>{"16-true", at::kHalf}}) {
    CAPTURE(name);
    auto p = precision(name);
    torch::nn::Linear linear(4, 2);
    p->convert_module(*linear);  // 16-true on CPU: checks a float16 matmul works here
    CHECK((linear->weight.scalar_type() == dtype));
    Batch batch{torch::randn({3, 4}), torch::tensor({0, 1, 1})};
    p->convert_input(batch);
    CHECK((batch.input.scalar_type() == dtype));
    CHECK((batch.target.scalar_type() == at::kLong));
    PrecisionScope scope(*p);
    CHECK((linear->forward(batch.input).scalar_type() == dtype));
  }
}

// ----------------------------------------------------------------------------------------------
// end to end through the Trainer

namespace {

struct TinyModule : fulgur::Module {
  TinyModule() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  StepOutput training_step(const Batch& b, int64_t) override {
    const at::Tensor out = fc2->forward(torch::relu(fc1->forward(b.input)));
    output_dtypes.push_back(out.scalar_type());
    return {torch::nn::functional::cross_entropy(out.to(fc2->weight.scalar_type()), b.target)};
  }
  std::vector<OptimizerConfig> configure_optimizers() override {
    return {OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.05)))};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  std::vector<at::ScalarType> output_dtypes;
};

struct TinyData : fulgur::DataModule {
  TinyData() {
    x = torch::randn({32, 8});
    y = (x.select(1, 0) > 0).to(at::kLong);
  }
  std::unique_ptr<BatchLoader> train_loader() override {
    return make_tensor_loader(x, y, TensorLoaderOptions().batch_size(8));
  }
  at::Tensor x, y;
};

}  // namespace

TEST_CASE("Trainer fits with each precision: compute dtype, parameter dtype, checkpointed scaler") {
  struct Case {
    std::string name;
    at::ScalarType compute;
    at::ScalarType params;
  };
  for (const Case& c : {Case{"bf16-mixed", at::kBFloat16, at::kFloat}, Case{"16-mixed", at::kBFloat16, at::kFloat},
                        Case{"64-true", at::kDouble, at::kDouble}, Case{"bf16-true", at::kBFloat16, at::kBFloat16}}) {
    CAPTURE(c.name);
    TempDir dir;
    const std::string text = fmt::format(R"(
[trainer]
default_root_dir = "{}"
seed = 3
precision = "{}"
max_steps = 4
enable_progress_bar = false
enable_model_summary = false
logger = false
gradient_clip_val = 1.0
)",
                                         dir.path().string(), c.name);
    fulgur::Trainer trainer(parse_config(text, dir / "test.toml"));
    TinyModule module;
    TinyData data;
    const at::Tensor before = module.fc1->weight.detach().clone();
    trainer.fit(module, data);
    CHECK(trainer.global_step() == 4);
    REQUIRE(module.output_dtypes.size() == 4);
    for (at::ScalarType t : module.output_dtypes) CHECK((t == c.compute));
    CHECK((module.fc1->weight.scalar_type() == c.params));
    CHECK_FALSE(torch::equal(module.fc1->weight.to(at::kFloat), before));
  }
}

// ----------------------------------------------------------------------------------------------
// manual optimization: OptimizerHandle::step goes through the precision plugin

namespace {

// The same network and loss stepped either by the Trainer (automatic) or by training_step through
// optimizer() (manual). `inf_batches` get an inf written into a (scaled) gradient after backward;
// so do the `inf_calls`-th calls of training_step (counted from 1: a captured step's batch_idx is
// the capture's, but a replay of the fixture graph calls training_step again).
struct StepModule : fulgur::Module {
  StepModule(bool manual, double clip, std::set<int64_t> inf_batches = {}, std::set<int64_t> inf_calls = {})
      : clip(clip), inf_batches(std::move(inf_batches)), inf_calls(std::move(inf_calls)) {
    automatic_optimization = !manual;
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  StepOutput training_step(const Batch& b, int64_t batch_idx) override {
    current_batch = batch_idx;
    ++calls;
    const at::Tensor out = fc2->forward(torch::relu(fc1->forward(b.input)));
    at::Tensor loss = torch::nn::functional::cross_entropy(out.to(at::kFloat), b.target);
    if (automatic_optimization) return {loss};
    OptimizerHandle opt = optimizer();
    opt.zero_grad();
    manual_backward(loss);
    clip_gradients(opt, clip);
    stepped.push_back(opt.step());
    return {loss};
  }
  void on_after_backward() override {
    if (!inf_batches.count(current_batch) && !inf_calls.count(calls)) return;
    torch::NoGradGuard no_grad;
    fc2->bias.grad()[0] = std::numeric_limits<float>::infinity();
  }
  std::vector<OptimizerConfig> configure_optimizers() override {
    adam = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01));
    return {OptimizerConfig(adam)};
  }
  // Adam's step count of every parameter (the host state a checkpoint saves).
  std::vector<int64_t> adam_steps() const {
    std::vector<int64_t> steps;
    for (const auto& [key, state] : adam->state())
      steps.push_back(static_cast<torch::optim::AdamParamState&>(*state).step());
    return steps;
  }
  double clip;
  std::set<int64_t> inf_batches, inf_calls;
  int64_t calls = 0;
  std::shared_ptr<torch::optim::Adam> adam;
  int64_t current_batch = -1;
  std::vector<bool> stepped;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// What each optimizer step looked like from the outside: the gradients on_before_optimizer_step
// saw, then the parameters and the loss scale after the batch.
struct StepRecorder : fulgur::Callback {
  explicit StepRecorder(bool record_grads = true) : record_grads(record_grads) {}
  // Without gradients (no hook inside the step) when the step is captured.
  HookSet hooks() const override {
    return record_grads ? Hook::before_optimizer_step | Hook::train_batch_end : HookSet(Hook::train_batch_end);
  }
  void on_before_optimizer_step(TrainerContext&, torch::optim::Optimizer& optimizer) override {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : optimizer.param_groups().front().params()) grads.push_back(p.grad().clone());
    grads_seen.push_back(std::move(grads));
  }
  void on_train_batch_end(TrainerContext& trainer, const StepOutput&, const Batch&, int64_t) override {
    params.push_back(snapshot(trainer.model()));
    c10::IValue state;
    precision->state_dict(state);  // the Trainer's plugin (fulgur::Trainer::precision())
    const c10::impl::GenericDict dict = state.toGenericDict();
    scales.push_back(dict.contains("scale") ? dict.at("scale").toDouble() : 0.0);
  }
  std::vector<std::vector<at::Tensor>> grads_seen;
  std::vector<std::vector<at::Tensor>> params;
  std::vector<double> scales;
  fulgur::Precision* precision = nullptr;
  bool record_grads;
};

struct StepRun {
  std::shared_ptr<StepRecorder> recorder;
  std::vector<bool> stepped;
  std::vector<int64_t> adam_steps;
  int64_t global_step = 0;
  std::vector<at::Tensor> final_params;
};

// Two epochs of TinyData (4 batches each) with the same seed, data order and initial weights.
// `trainer_lines` go into [trainer]; `plugin_dir` (if set) is searched for plugins.
StepRun run_steps(const std::string& precision_table, bool manual, double clip, std::set<int64_t> inf_batches = {},
                  std::set<int64_t> inf_calls = {}, const std::string& trainer_lines = "",
                  const std::filesystem::path& plugin_dir = {}) {
  TempDir dir;
  const std::string text =
      fmt::format(R"(
[trainer]
default_root_dir = "{}"
seed = 11
max_epochs = 2
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
gradient_clip_val = {}
{}
{}
{}
)",
                  dir.path().string(), manual ? 0.0 : clip, trainer_lines, precision_table,
                  plugin_dir.empty() ? "" : fmt::format("[plugins]\npaths = [\"{}\"]", plugin_dir.string()));
  fulgur::Trainer trainer(parse_config(text, dir / "test.toml"));
  torch::manual_seed(5);
  StepModule module(manual, clip, std::move(inf_batches), std::move(inf_calls));
  torch::manual_seed(6);
  TinyData data;
  StepRun run;
  run.recorder =
      std::make_shared<StepRecorder>(/*record_grads=*/trainer_lines.find("cuda_graphs") == std::string::npos);
  run.recorder->precision = &trainer.precision();
  trainer.add_callback(run.recorder);
  trainer.fit(module, data);
  run.stepped = module.stepped;
  run.adam_steps = module.adam_steps();
  run.global_step = trainer.global_step();
  run.final_params = snapshot(module);
  return run;
}

}  // namespace

TEST_CASE("manual optimization under 16-mixed: an inf gradient skips the step and halves the scale, as automatic") {
  // growth_interval 2 makes the scale also grow within the run; the inf batches (global indices
  // 1 and 5, the second in the second epoch) each halve it and leave the weights untouched.
  const std::string table = R"(precision = "16-mixed"
[precision]
init_scale = 1024.0
growth_interval = 2)";
  const std::set<int64_t> inf_at = {1};  // batch_idx within each epoch -> global batches 1 and 5
  const StepRun manual = run_steps(table, /*manual=*/true, /*clip=*/0.0, inf_at);
  const StepRun automatic = run_steps(table, /*manual=*/false, /*clip=*/0.0, inf_at);

  const std::vector<bool> expected_steps = {true, false, true, true, true, false, true, true};
  CHECK(manual.stepped == expected_steps);
  // The scale after each batch: 1024 (1 good), 512 (inf), 512 (1 good), 1024 (2 good: grow), ...
  const std::vector<double> expected_scales = {1024, 512, 512, 1024, 1024, 512, 512, 1024};
  CHECK(manual.recorder->scales == expected_scales);
  CHECK(automatic.recorder->scales == expected_scales);
  CHECK(manual.global_step == 8);
  CHECK(automatic.global_step == 8);

  // A skipped step leaves every parameter as the previous batch left it; a taken one changes them.
  // Automatic optimization skips on the device (the fused Adam kernel reads found_inf), manual
  // through the host's decision (OptimizerHandle::step returns it).
  REQUIRE(manual.recorder->params.size() == 8);
  REQUIRE(automatic.recorder->params.size() == 8);
  for (size_t i = 1; i < 8; ++i) {
    CAPTURE(i);
    CHECK(same(manual.recorder->params[i], manual.recorder->params[i - 1]) == !expected_steps[i]);
    CHECK(same(automatic.recorder->params[i], automatic.recorder->params[i - 1]) == !expected_steps[i]);
  }
  // The skipped steps are not counted: Adam's bias correction after 6 steps, not 8. The device's
  // counts reached the host state when the fit ended.
  CHECK(manual.adam_steps == std::vector<int64_t>(4, 6));
  CHECK(automatic.adam_steps == std::vector<int64_t>(4, 6));
  // on_before_optimizer_step ran for every step() call, on unscaled gradients (the injected inf
  // stays inf; the others match automatic optimization, which unscales at the same point). The
  // gradients match bit for bit; the weights to rounding (fused kernel against Adam::step()).
  REQUIRE(manual.recorder->grads_seen.size() == 8);
  REQUIRE(automatic.recorder->grads_seen.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    const at::Tensor& bias_grad = manual.recorder->grads_seen[i].back();
    CHECK(std::isinf(bias_grad[0].item<float>()) == !expected_steps[i]);
    for (size_t k = 0; k < manual.recorder->grads_seen[i].size(); ++k)
      CHECK(torch::equal(manual.recorder->grads_seen[i][k], automatic.recorder->grads_seen[i][k]));
  }
  for (size_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    CHECK(close(manual.recorder->params[i], automatic.recorder->params[i]));
  }

  // With clipping: Module::clip_gradients unscales before clipping, as the Trainer's clipping
  // does, so the weights and scales still match automatic optimization's.
  const StepRun manual_clipped = run_steps(table, /*manual=*/true, /*clip=*/0.05, inf_at);
  const StepRun automatic_clipped = run_steps(table, /*manual=*/false, /*clip=*/0.05, inf_at);
  CHECK(manual_clipped.stepped == expected_steps);
  CHECK(manual_clipped.recorder->scales == expected_scales);
  CHECK(automatic_clipped.recorder->scales == expected_scales);
  CHECK(close(manual_clipped.final_params, automatic_clipped.final_params));
  CHECK_FALSE(close(manual_clipped.final_params, manual.final_params));
}

TEST_CASE("16-mixed under cuda_graphs: skips and scale updates are recorded in the step and replayed") {
  // The fixture accelerator replays a step by running it again, so the inf written by the 2nd
  // and 6th calls of training_step lands in a warm-up step and in a replay. Batches 0-2 warm up,
  // batch 3 is the epoch's last (warm-up too), batch 4 is captured and replayed, 5-7 replay.
  TempDir plugins;
  test::copy_library(test::fixture("libfulgur-fixture-replay-graph.so"), plugins / "libfulgur-fixture-replay-graph.so");
  const std::string table = R"(precision = "16-mixed"
[precision]
init_scale = 1024.0
growth_interval = 2)";
  const std::set<int64_t> inf_calls = {2, 6};
  const StepRun uncaptured =
      run_steps(table, /*manual=*/false, 0.0, {}, inf_calls, "accelerator = \"fixture_replay_graph\"", plugins.path());
  const StepRun captured = run_steps(table, /*manual=*/false, 0.0, {}, inf_calls,
                                     "accelerator = \"fixture_replay_graph\"\ncuda_graphs = \"on\"", plugins.path());
  const std::vector<double> expected_scales = {1024, 512, 512, 1024, 1024, 512, 512, 1024};
  CHECK(uncaptured.recorder->scales == expected_scales);
  CHECK(captured.recorder->scales == expected_scales);
  const std::vector<bool> expected_steps = {true, false, true, true, true, false, true, true};
  REQUIRE(captured.recorder->params.size() == 8);
  for (size_t i = 1; i < 8; ++i) {
    CAPTURE(i);
    CHECK(same(captured.recorder->params[i], captured.recorder->params[i - 1]) == !expected_steps[i]);
    CHECK(close(captured.recorder->params[i], uncaptured.recorder->params[i]));
  }
  CHECK(captured.adam_steps == std::vector<int64_t>(4, 6));
  CHECK(uncaptured.adam_steps == std::vector<int64_t>(4, 6));
  CHECK(captured.global_step == 8);
}

TEST_CASE("manual optimization under 32-true gives the same weights as automatic optimization (with clipping)") {
  for (double clip : {0.0, 0.05}) {
    CAPTURE(clip);
    const StepRun manual = run_steps(R"(precision = "32-true")", /*manual=*/true, clip);
    const StepRun automatic = run_steps(R"(precision = "32-true")", /*manual=*/false, clip);
    CHECK(manual.stepped == std::vector<bool>(8, true));
    CHECK(manual.global_step == automatic.global_step);
    CHECK(manual.recorder->grads_seen.size() == 8);
    CHECK(same(manual.final_params, automatic.final_params));
    // Not trivially equal: training moved the weights, and clipping changes where they end up.
    CHECK_FALSE(same(manual.final_params, manual.recorder->params.front()));
  }
  const StepRun unclipped = run_steps(R"(precision = "32-true")", true, 0.0);
  const StepRun clipped = run_steps(R"(precision = "32-true")", true, 0.05);
  CHECK_FALSE(same(unclipped.final_params, clipped.final_params));
}

TEST_CASE("manual optimization: several optimizers, and misuse fails clearly") {
  // Two optimizers over two layers, each stepped through its own handle.
  struct TwoOptimizers : StepModule {
    TwoOptimizers() : StepModule(/*manual=*/true, 0.0) {}
    StepOutput training_step(const Batch& b, int64_t) override {
      const std::vector<OptimizerHandle> opts = optimizers();
      REQUIRE(opts.size() == 2);
      for (const OptimizerHandle& opt : opts) {
        OptimizerHandle handle = opt;
        handle.zero_grad();
      }
      const at::Tensor loss =
          torch::nn::functional::cross_entropy(fc2->forward(torch::relu(fc1->forward(b.input))), b.target);
      manual_backward(loss);
      for (OptimizerHandle opt : opts) stepped.push_back(opt.step());
      return {loss};
    }
    std::vector<OptimizerConfig> configure_optimizers() override {
      return {OptimizerConfig(std::make_shared<torch::optim::SGD>(fc1->parameters(), torch::optim::SGDOptions(0.1))),
              OptimizerConfig(std::make_shared<torch::optim::SGD>(fc2->parameters(), torch::optim::SGDOptions(0.1)))};
    }
  };
  TempDir dir;
  const std::string base = fmt::format(R"(
[trainer]
default_root_dir = "{}"
max_steps = 3
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
precision = "16-mixed"
)",
                                       dir.path().string());
  {
    fulgur::Trainer trainer(parse_config(base, dir / "a.toml"));
    TwoOptimizers module;
    TinyData data;
    const at::Tensor fc1_before = module.fc1->weight.detach().clone();
    const at::Tensor fc2_before = module.fc2->weight.detach().clone();
    trainer.fit(module, data);
    // Each optimizer.step() is a global step, as in Lightning (issue #34.4): 2 per batch, so
    // max_steps = 3 is reached after the second batch, at 4.
    CHECK(module.stepped == std::vector<bool>(4, true));
    CHECK(trainer.global_step() == 4);
    CHECK_FALSE(torch::equal(module.fc1->weight, fc1_before));
    CHECK_FALSE(torch::equal(module.fc2->weight, fc2_before));
  }

  // Trainer-level clipping and accumulation cannot apply under manual optimization (Lightning
  // refuses them too).
  {
    fulgur::Trainer trainer(parse_config(base + "gradient_clip_val = 1.0\n", dir / "b.toml"));
    StepModule module(/*manual=*/true, 0.0);
    TinyData data;
    const Error e = error_from([&] { trainer.fit(module, data); });
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(), "gradient_clip_val");
    FULGUR_CHECK_CONTAINS(e.what(), "clip_gradients");
  }
  {
    fulgur::Trainer trainer(parse_config(base + "accumulate_grad_batches = 2\n", dir / "b2.toml"));
    StepModule module(/*manual=*/true, 0.0);
    TinyData data;
    const Error e = error_from([&] { trainer.fit(module, data); });
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(), "accumulate_grad_batches = 2");
  }

  // step() under automatic optimization would step twice per batch.
  {
    struct StepsAnyway : StepModule {
      StepsAnyway() : StepModule(/*manual=*/false, 0.0) {}
      StepOutput training_step(const Batch& b, int64_t i) override {
        optimizer().step();
        return StepModule::training_step(b, i);
      }
    };
    fulgur::Trainer trainer(parse_config(base, dir / "c.toml"));
    StepsAnyway module;
    TinyData data;
    const Error e = error_from([&] { trainer.fit(module, data); });
    FULGUR_CHECK_CONTAINS(e.what(), "automatic_optimization = false");
  }

  // Outside a Trainer there is nothing to step through; an index past the end names the count.
  StepModule idle(/*manual=*/true, 0.0);
  CHECK(idle.optimizers().empty());
  FULGUR_CHECK_CONTAINS(error_from([&] { idle.optimizer(); }).what(), "running Trainer");
  torch::optim::SGD sgd(idle.parameters(), torch::optim::SGDOptions(0.1));
  OptimizerHandle detached(idle, sgd);
  FULGUR_CHECK_CONTAINS(error_from([&] { detached.step(); }).what(), "running Trainer");
  FULGUR_CHECK_CONTAINS(error_from([&] { idle.clip_gradients(detached, 1.0); }).what(), "running Trainer");
  {
    struct AsksForSecond : StepModule {
      AsksForSecond() : StepModule(/*manual=*/true, 0.0) {}
      StepOutput training_step(const Batch&, int64_t) override {
        optimizer(1);
        return {};
      }
    };
    fulgur::Trainer trainer(parse_config(base, dir / "d.toml"));
    AsksForSecond module;
    TinyData data;
    FULGUR_CHECK_CONTAINS(error_from([&] { trainer.fit(module, data); }).what(), "returned 1 optimizer(s)");
  }
}

// ----------------------------------------------------------------------------------------------
// true dtypes: the setup-time kernel check

TEST_CASE("16-true fails at setup on a device without float16 matmul, naming the precision and what to use") {
  // The plugins run mixed_precision::require_matmul_support on the module's device. This CPU
  // has float16 matmul, so drive the same function with a device type this LibTorch build has no
  // kernels for at all (XLA): the probe fails for real and the message must say what to do.
  CHECK(mixed_precision::matmul_failure(c10::Device(c10::DeviceType::CPU), at::kHalf).empty());
  CHECK_NOTHROW(mixed_precision::require_matmul_support("16-true", c10::Device(c10::DeviceType::CPU), at::kHalf,
                                                        "\"bf16-true\""));
  const c10::Device missing(c10::DeviceType::XLA, 0);
  CHECK_FALSE(mixed_precision::matmul_failure(missing, at::kHalf).empty());
  const Error e = error_from([&] {
    mixed_precision::require_matmul_support("16-true", missing, at::kHalf,
                                            "\"bf16-true\" or \"bf16-mixed\" (or \"32-true\")");
  });
  CHECK(e.kind() == ErrorKind::config);
  const std::string message = e.what();
  FULGUR_CHECK_CONTAINS(message, "precision '16-true' is not supported on device xla:0");
  FULGUR_CHECK_CONTAINS(message, "Half matmul fails");
  FULGUR_CHECK_CONTAINS(message, "use precision = \"bf16-true\" or \"bf16-mixed\" (or \"32-true\") instead");
  CHECK(message.find('\n') == std::string::npos);  // one line: LibTorch's dispatch-key dump is cut

  // Through the plugin on this CPU: the check passes and the module is converted.
  auto p = precision("16-true");
  torch::nn::Linear linear(2, 2);
  CHECK_NOTHROW(p->convert_module(*linear));
  CHECK((linear->weight.scalar_type() == at::kHalf));
}

}  // namespace fulgur
