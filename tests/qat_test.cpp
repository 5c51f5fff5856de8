// Quantization-aware training beyond the weight (SDK 1.5, #38 item 2): the input fake-quantized to
// int8 per token or per tensor (torchao's asymmetric qparams), and LSQ's learnable scales, checked
// against hand-computed values, gradients included; the learned scales are the stored ones.
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/nn/linear.h>
#include <fulgur/trainer.h>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "test_support.h"

namespace {

using fulgur::nn::ActivationQuantization;
using fulgur::nn::FakeQuantizeOptions;
using fulgur::nn::QatOptions;
using fulgur::nn::QuantizeOptions;
using fulgur::nn::WeightQuantization;
using fulgur::test::contains;
using fulgur::test::error_from;

// A layer whose int8 fake-quantized weight is the identity (127 · (1 / 127) per row), so that its
// output is its fake-quantized input.
fulgur::nn::Linear identity(int64_t n, ActivationQuantization activations) {
  fulgur::nn::Linear layer(n, n);
  torch::NoGradGuard no_grad;
  layer->weight.copy_(torch::eye(n));
  layer->bias.zero_();
  layer->quantization_aware_training(QatOptions(WeightQuantization::int8).activations(activations));
  return layer;
}

// y = x A + b through one fulgur::nn::Linear, which trains its int4 weight scales and its
// per-tensor input scale (LSQ) when `lsq` is set, as the qat callback would make it.
class LsqLine : public fulgur::Module {
 public:
  explicit LsqLine(bool lsq) {
    fc = register_module("fc", fulgur::nn::Linear(64, 3));
    if (lsq)
      fc->quantization_aware_training(QatOptions(FakeQuantizeOptions(WeightQuantization::int4).group_size(32))
                                          .activations(ActivationQuantization::per_tensor)
                                          .learnable_scales(true));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    return {torch::mse_loss(fc->forward(batch.input), batch.target)};
  }
  at::Tensor predict_step(const fulgur::Batch& batch, int64_t) override { return fc->forward(batch.input); }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), 1e-2))};
  }
  fulgur::nn::Linear fc{nullptr};
};

struct LineData : fulgur::DataModule {
  at::Tensor x = torch::randn({96, 64}, at::detail::createCPUGenerator(7));
  at::Tensor y = x.narrow(1, 0, 3) * 2 - 1;
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(32));
  }
  std::unique_ptr<fulgur::BatchLoader> predict_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(32));
  }
};

fulgur::Trainer lsq_trainer(const std::filesystem::path& root, int epochs) {
  return fulgur::Trainer(fulgur::parse_config(
      fmt::format("[trainer]\ndefault_root_dir = \"{}\"\nseed = 3\nmax_epochs = {}\nenable_progress_bar = false\n"
                  "enable_model_summary = false\nenable_checkpointing = false\nlogger = false\n",
                  root.string(), epochs),
      root / "lsq.toml"));
}

}  // namespace

TEST_CASE("#38.2 activations per token: torchao's asymmetric int8 scale and zero point, as computed by hand") {
  // Row 1: [0, 2.55] -> scale 0.01, zero point -128 (the minimum is 0); 0.3 -> code -98, 1.234 ->
  // round(123.4 - 128) = -5 -> (-5 + 128) 0.01 = 1.23.
  // Row 2: [-1, 1.55] -> scale 0.01; from the minimum -128 + 100 = -28, so 0.456 -> round(45.6) - 28
  // = 18 -> 0.46, and the ends -1 and 1.55 land on codes -128 and 127.
  const at::Tensor x = torch::tensor({{0.f, 0.3f, 1.234f, 2.55f}, {-1.f, 0.456f, 0.f, 1.55f}}).requires_grad_(true);
  fulgur::nn::Linear layer = identity(4, ActivationQuantization::per_token);
  CHECK((layer->qat_options().activations() == ActivationQuantization::per_token));
  const at::Tensor y = layer->forward(x);
  const at::Tensor expected = torch::tensor({{0.f, 0.3f, 1.23f, 2.55f}, {-1.f, 0.46f, 0.f, 1.55f}});
  CHECK(torch::allclose(y, expected, 0, 1e-5));
  // Straight through inside the range: the input's gradient is the fake weight's (the identity).
  y.sum().backward();
  CHECK(torch::allclose(x.grad(), torch::ones_like(x), 0, 1e-5));
  // Off: the input goes through unchanged.
  layer->quantization_aware_training(QatOptions(WeightQuantization::int8));
  CHECK(torch::allclose(layer->forward(x), x, 0, 1e-5));
}

TEST_CASE("#38.2 activations per tensor: one scale for the whole input, from its min and max") {
  const at::Tensor x = torch::tensor({{0.f, 0.3f, 1.234f, 2.55f}, {-1.f, 0.456f, 0.f, 1.55f}});
  fulgur::nn::Linear layer = identity(4, ActivationQuantization::per_tensor);
  // [-1, 2.55]: scale 3.55 / 255, zero point round(-128 + 1 / scale) = -56; no code is clipped, so
  // each value is round(x / scale) · scale.
  const double scale = 3.55 / 255;
  const at::Tensor expected = torch::round(x.to(at::kDouble) / scale) * scale;
  CHECK(torch::allclose(layer->forward(x).to(at::kDouble), expected, 0, 1e-5));
  // Different from per token: the second row is on a coarser grid than its own range needs.
  CHECK_FALSE(torch::allclose(layer->forward(x), identity(4, ActivationQuantization::per_token)->forward(x), 0, 1e-4));
}

TEST_CASE("#38.2 LSQ: the weight scale's gradient is LSQ's, scaled by 1/sqrt(numel * qmax)") {
  fulgur::nn::Linear layer(fulgur::nn::LinearOptions(4, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    layer->weight.copy_(torch::tensor({{1.27f, -0.635f, 0.29f, 0.01f}}));
  }
  layer->quantization_aware_training(QatOptions(WeightQuantization::int8).learnable_scales(true));
  // Initialized from the weight: max |w| / 127, a parameter the optimizer sees, in the state dict.
  const at::Tensor scale = layer->named_parameters()["weight_scale"];
  CHECK(scale.item<float>() == doctest::Approx(0.01).epsilon(1e-6));
  CHECK(layer->named_parameters().size() == 2);
  {
    torch::NoGradGuard no_grad;
    scale.fill_(0.008);
  }
  // v = w / 0.008 = [158.75, -79.375, 36.25, 1.25]: the first clipped to 127, the others rounded
  // to -79, 36, 1. y = 0.008 (127·1 − 79·2 + 36·3 + 1·4) = 0.648.
  const at::Tensor x = torch::tensor({{1.f, 2.f, 3.f, 4.f}});
  const at::Tensor y = layer->forward(x);
  CHECK(y.item<float>() == doctest::Approx(0.648).epsilon(1e-5));
  y.sum().backward();
  // d y / d s = Σ x_i (clipped: 127; inside: round(v) − v) · g
  //           = (127·1 + 0.375·2 − 0.25·3 − 0.25·4) / sqrt(4 · 127) = 126 / sqrt(508).
  CHECK(scale.grad().item<float>() == doctest::Approx(126.0 / std::sqrt(508.0)).epsilon(1e-5));
  // The weight's gradient is clipped straight-through: 0 where clipped, x elsewhere.
  CHECK(torch::allclose(layer->weight.grad(), torch::tensor({{0.f, 2.f, 3.f, 4.f}}), 0, 1e-6));
}

TEST_CASE("#38.2 LSQ: the per_tensor input scale and offset learn with LSQ+'s gradients") {
  fulgur::nn::Linear layer(fulgur::nn::LinearOptions(2, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    layer->weight.copy_(torch::tensor({{1.27f, 0.64f}}));  // codes 127 and 64 at scale 0.01: exact
  }
  layer->quantization_aware_training(
      QatOptions(WeightQuantization::int8).activations(ActivationQuantization::per_tensor).learnable_scales(true));
  auto params = layer->named_parameters();
  REQUIRE(params.contains("input_scale"));
  REQUIRE(params.contains("input_zero"));
  // Zero until the first batch initializes them from its range (the min/max scale).
  CHECK(params["input_scale"].item<float>() == 0.f);
  layer->forward(torch::tensor({{-1.f, 1.55f}}));
  CHECK(params["input_scale"].item<float>() == doctest::Approx(0.01).epsilon(1e-5));
  CHECK(params["input_zero"].item<float>() == doctest::Approx(0.28).epsilon(1e-5));  // −(−28) · 0.01
  {
    torch::NoGradGuard no_grad;
    params["input_scale"].fill_(0.01);
    params["input_zero"].fill_(0.0);
  }
  // x = [0.5, −3]: v = [50, −300], the second clipped to −128: x̂ = [0.5, −1.28];
  // y = 1.27·0.5 + 0.64·(−1.28) = −0.1842.
  const at::Tensor x = torch::tensor({{0.5f, -3.f}}).requires_grad_(true);
  const at::Tensor y = layer->forward(x);
  CHECK(y.item<float>() == doctest::Approx(-0.1842).epsilon(1e-4));
  y.sum().backward();
  const double g = 1 / std::sqrt(2 * 127.0);
  // d x̂ / d s = [round(50) − 50, −128], d x̂ / d zero = [0, 1], d x̂ / d x = [1, 0].
  CHECK(params["input_scale"].grad().item<float>() == doctest::Approx(0.64 * -128 * g).epsilon(1e-4));
  CHECK(params["input_zero"].grad().item<float>() == doctest::Approx(0.64 * g).epsilon(1e-4));
  CHECK(torch::allclose(x.grad(), torch::tensor({{1.27f, 0.f}}), 0, 1e-5));
}

TEST_CASE("#38.2 LSQ: quantize_weight stores the learned scales, and the stored layer computes the trained one") {
  for (const auto method : {WeightQuantization::int8, WeightQuantization::int4}) {
    CAPTURE(fulgur::nn::to_string(method));
    torch::manual_seed(4);
    fulgur::nn::Linear layer(80, 8);  // int4 group 32: two whole groups and one of 16
    layer->quantization_aware_training(QatOptions(FakeQuantizeOptions(method).group_size(32)).learnable_scales(true));
    // A few SGD steps move weights and scales away from their min/max start.
    torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.05));
    const at::Tensor x = torch::randn({16, 80});
    const at::Tensor target = torch::randn({16, 8});
    const at::Tensor start = layer->named_parameters()["weight_scale"].detach().clone();
    for (int step = 0; step < 5; ++step) {
      sgd.zero_grad();
      (layer->forward(x) - target).pow(2).mean().backward();
      sgd.step();
    }
    const at::Tensor learned = layer->named_parameters()["weight_scale"].detach().clone();
    CHECK_FALSE(torch::equal(learned, start));
    const at::Tensor trained = layer->forward(x).detach();
    // Asking for another storage than the one learned is refused, naming both.
    const auto other = method == WeightQuantization::int8 ? QuantizeOptions(WeightQuantization::int4).group_size(32)
                                                          : QuantizeOptions(WeightQuantization::int4).group_size(64);
    CHECK(contains(error_from([&] { layer->quantize_weight(other); }).what(), "learned its scales for"));
    layer->quantize_weight(QuantizeOptions(method).group_size(32));
    CHECK(torch::equal(layer->named_buffers()["weight_scale"], learned));
    CHECK(layer->named_parameters().size() == 1);  // the bias; the learned scales became buffers
    CHECK(torch::allclose(layer->forward(x), trained, 1e-5, 1e-5));
  }
}

TEST_CASE("#38.2 LSQ: a state dict with learned scales loads into a fresh model after prepare_learned_scales") {
  torch::nn::Sequential trained;
  trained->push_back("fc1", fulgur::nn::Linear(64, 32));
  trained->push_back("fc2", fulgur::nn::Linear(32, 4));
  trained->push_back("fc3", fulgur::nn::Linear(32, 4));
  auto layer = [](torch::nn::Sequential& s, size_t i) { return s[i]->as<fulgur::nn::LinearImpl>(); };
  layer(trained, 0)
      ->quantization_aware_training(QatOptions(FakeQuantizeOptions(WeightQuantization::int4).group_size(32))
                                        .activations(ActivationQuantization::per_tensor)
                                        .learnable_scales(true));
  layer(trained, 1)->quantization_aware_training(QatOptions(WeightQuantization::int8).learnable_scales(true));
  std::map<std::string, at::Tensor> state;
  for (const auto& p : trained->named_parameters()) state.emplace(p.key(), p.value());
  CHECK(state.count("fc1.input_scale") == 1);
  torch::nn::Sequential fresh;
  fresh->push_back("fc1", fulgur::nn::Linear(64, 32));
  fresh->push_back("fc2", fulgur::nn::Linear(32, 4));
  fresh->push_back("fc3", fulgur::nn::Linear(32, 4));
  CHECK((fulgur::nn::prepare_learned_scales(*fresh, state) == std::vector<std::string>{"fc1", "fc2"}));
  const QatOptions fc1 = layer(fresh, 0)->qat_options();
  CHECK((fc1.weight().method() == WeightQuantization::int4));
  CHECK(fc1.weight().group_size() == 32);  // two groups of 64 inputs: the smallest size that gives 2
  CHECK((fc1.activations() == ActivationQuantization::per_tensor));
  CHECK(layer(fresh, 1)->qat_options().learnable_scales());
  CHECK((layer(fresh, 2)->qat_options().weight().method() == WeightQuantization::none));
  std::vector<std::string> expected, got;
  for (const auto& p : trained->named_parameters()) expected.push_back(p.key());
  for (const auto& p : fresh->named_parameters()) got.push_back(p.key());
  std::sort(expected.begin(), expected.end());
  std::sort(got.begin(), got.end());
  CHECK(got == expected);
  // The same options again keep what was learned (the qat callback's setup after a load).
  torch::NoGradGuard no_grad;
  layer(fresh, 1)->named_parameters()["weight_scale"].fill_(0.5);
  layer(fresh, 1)->quantization_aware_training(QatOptions(WeightQuantization::int8).learnable_scales(true));
  CHECK(layer(fresh, 1)->named_parameters()["weight_scale"].min().item<float>() == 0.5f);
}

TEST_CASE("#38.2 quantization-aware training options: bad names and combinations are refused clearly") {
  CHECK((fulgur::nn::activation_quantization_from_string("per_token") == ActivationQuantization::per_token));
  CHECK(fulgur::nn::to_string(ActivationQuantization::per_tensor) == "per_tensor");
  CHECK(contains(error_from([] { fulgur::nn::activation_quantization_from_string("per_row"); }).what(),
                 "unknown activation quantization 'per_row': use \"none\", \"per_token\" or \"per_tensor\""));
  fulgur::nn::Linear layer(64, 8);
  CHECK(contains(error_from([&] {
                   layer->quantization_aware_training(
                       QatOptions(WeightQuantization::none).activations(ActivationQuantization::per_token));
                 }).what(),
                 "trained together with a weight method"));
  CHECK(contains(error_from([&] {
                   layer->quantization_aware_training(
                       QatOptions(FakeQuantizeOptions(WeightQuantization::int4).group_size(48)));
                 }).what(),
                 "group_size must be 32, 64, 128 or 256, got 48"));
  // Off drops the learned scales.
  layer->quantization_aware_training(QatOptions(WeightQuantization::int8).learnable_scales(true));
  CHECK(layer->named_parameters().size() == 3);
  layer->fake_quantize(WeightQuantization::none);
  CHECK(layer->named_parameters().size() == 2);
  CHECK_FALSE(layer->qat_options().learnable_scales());
}

TEST_CASE("#38.2 a converted layer keeps its int8 inputs: per token, and learned per tensor through a file") {
  struct Net : torch::nn::Module {
    Net() { fc = register_module("fc", fulgur::nn::Linear(64, 16)); }
    fulgur::nn::Linear fc{nullptr};
  };
  for (const auto activations : {ActivationQuantization::per_token, ActivationQuantization::per_tensor}) {
    CAPTURE(fulgur::nn::to_string(activations));
    torch::manual_seed(6);
    Net trained;
    const bool learned = activations == ActivationQuantization::per_tensor;
    trained.fc->quantization_aware_training(QatOptions(FakeQuantizeOptions(WeightQuantization::int4).group_size(32))
                                                .activations(activations)
                                                .learnable_scales(learned));
    const at::Tensor x = torch::randn({8, 64}) * 3;
    torch::optim::SGD sgd(trained.parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 3; ++step) {
      sgd.zero_grad();
      trained.fc->forward(x).pow(2).mean().backward();
      sgd.step();
    }
    const at::Tensor expected = trained.fc->forward(x).detach();
    CHECK(fulgur::nn::quantize_linear_weights(trained, QuantizeOptions(WeightQuantization::int4).group_size(32)) ==
          std::vector<std::string>{"fc"});
    // Served: the same int8 inputs, the stored int4 weight.
    CHECK(torch::allclose(trained.fc->forward(x), expected, 1e-5, 1e-5));
    CHECK((trained.fc->qat_options().activations() == activations));
    CHECK(trained.named_buffers().contains("fc.input_scale") == learned);
    // Through a file: the metadata `fulgur quantize` writes rebuilds the layer, input scales included.
    std::map<std::string, std::string> metadata = {{"fulgur.quantization", "int4"},
                                                   {"fulgur.group_size", "32"},
                                                   {"fulgur.quantized_layers", "fc"},
                                                   {"fulgur.activations", fulgur::nn::to_string(activations)}};
    if (learned) metadata.emplace("fulgur.input_scales", "learned");
    Net served;
    CHECK(fulgur::nn::prepare_quantized_layers(served, metadata));
    {
      torch::NoGradGuard no_grad;
      for (const auto& b : trained.named_buffers()) served.named_buffers()[b.key()].copy_(b.value());
      served.named_parameters()["fc.bias"].copy_(trained.named_parameters()["fc.bias"]);
    }
    CHECK(served.named_buffers().size() == trained.named_buffers().size());
    CHECK(torch::allclose(served.fc->forward(x), expected, 1e-5, 1e-5));
    // Without the activations it is another model: the check above is not vacuous.
    Net weight_only;
    metadata.erase("fulgur.activations");
    metadata.erase("fulgur.input_scales");
    fulgur::nn::prepare_quantized_layers(weight_only, metadata);
    {
      torch::NoGradGuard no_grad;
      for (const auto& b : weight_only.named_buffers()) b.value().copy_(trained.named_buffers()[b.key()]);
      weight_only.named_parameters()["fc.bias"].copy_(trained.named_parameters()["fc.bias"]);
    }
    CHECK_FALSE(torch::allclose(weight_only.fc->forward(x), expected, 1e-5, 1e-5));
  }
  Net bad;
  CHECK(contains(error_from([&] {
                   fulgur::nn::prepare_quantized_layers(bad, {{"fulgur.quantization", "int8"},
                                                              {"fulgur.quantized_layers", "fc"},
                                                              {"fulgur.input_scales", "learned"}});
                 }).what(),
                 "must say \"fulgur.activations\" = \"per_tensor\""));
}

TEST_CASE("#38.2 LSQ through the Trainer API: predict and fit resume a checkpoint with learned scales") {
  fulgur::test::TempDir dir;
  LineData data;
  const std::string ckpt = (dir / "lsq.ckpt").string();
  std::vector<at::Tensor> trained_out;
  {
    fulgur::Trainer trainer = lsq_trainer(dir.path(), 2);
    LsqLine trained(/*lsq=*/true);
    trainer.fit(trained, data);
    trainer.save_checkpoint(ckpt);
    trained_out = trainer.predict(trained, data);
  }
  // A plain float model, as a program builds it without the qat callback: predict loads the
  // checkpoint strictly, its layer takes the learned scales, and serves what the trained one did.
  {
    fulgur::Trainer trainer = lsq_trainer(dir.path(), 2);
    LsqLine fresh(/*lsq=*/false);
    const std::vector<at::Tensor> out = trainer.predict(fresh, data, ckpt);
    REQUIRE(out.size() == trained_out.size());
    for (size_t i = 0; i < out.size(); ++i) CHECK(torch::equal(out[i], trained_out[i]));
    const QatOptions qat = fresh.fc->qat_options();
    CHECK(qat.learnable_scales());
    CHECK((qat.weight().method() == WeightQuantization::int4));
    CHECK((qat.activations() == ActivationQuantization::per_tensor));
  }
  // fit resumes it with the same quantization-aware training, scales and optimizer state included.
  {
    fulgur::Trainer trainer = lsq_trainer(dir.path(), 3);
    LsqLine resumed(/*lsq=*/true);
    trainer.fit(resumed, data, ckpt);
    CHECK(trainer.current_epoch() == 3);
  }
  // fit with a float model: the optimizers exist already and would not train the scales; refused.
  {
    fulgur::Trainer trainer = lsq_trainer(dir.path(), 3);
    LsqLine fresh(/*lsq=*/false);
    const std::string error = error_from([&] { trainer.fit(fresh, data, ckpt); }).what();
    CHECK_MESSAGE(contains(error, "the layers fc learned their quantization scales (LSQ)"), error);
    CHECK_MESSAGE(contains(error, "learnable_scales(true)"), error);
  }
}

TEST_CASE("#38.2 clone() copies a layer with learned scales, and a quantized one, with their own tensors") {
  const at::Tensor x = torch::randn({5, 64}, at::detail::createCPUGenerator(11));
  fulgur::nn::Linear lsq(64, 3);
  lsq->quantization_aware_training(QatOptions(FakeQuantizeOptions(WeightQuantization::int4).group_size(32))
                                       .activations(ActivationQuantization::per_tensor)
                                       .learnable_scales(true));
  const at::Tensor expected = lsq->forward(x);  // the first batch sets the input scale
  const auto copy = std::dynamic_pointer_cast<fulgur::nn::LinearImpl>(lsq->clone());
  REQUIRE(copy);
  std::vector<std::string> names, copied;
  for (const auto& p : lsq->named_parameters()) names.push_back(p.key());
  for (const auto& p : copy->named_parameters()) copied.push_back(p.key());
  CHECK(copied == names);  // weight, bias, weight_scale, weight_zero, input_scale, input_zero
  CHECK(names.size() == 6);
  for (const auto& p : lsq->named_parameters()) {
    const at::Tensor& c = copy->named_parameters()[p.key()];
    CHECK_MESSAGE(torch::equal(c, p.value()), p.key());
    CHECK_MESSAGE(c.data_ptr() != p.value().data_ptr(), p.key());
  }
  CHECK(copy->qat_options().learnable_scales());
  CHECK(torch::equal(copy->forward(x), expected));
  // Its scales are its own: a step on the copy leaves the original's alone.
  {
    torch::NoGradGuard no_grad;
    copy->named_parameters()["weight_scale"].mul_(2);
  }
  CHECK(torch::equal(lsq->forward(x), expected));
  CHECK(!torch::equal(copy->forward(x), expected));

  // A quantized int4 layer: its buffers (codes, scales, zeros, learned input scale) come along.
  lsq->quantize_weight(QuantizeOptions(WeightQuantization::int4).group_size(32));
  const at::Tensor served = lsq->forward(x);
  const auto quantized = std::dynamic_pointer_cast<fulgur::nn::LinearImpl>(lsq->clone());
  REQUIRE(quantized);
  CHECK((quantized->quantization() == WeightQuantization::int4));
  CHECK(quantized->named_buffers().size() == lsq->named_buffers().size());
  CHECK((quantized->weight.scalar_type() == at::kByte));
  CHECK(torch::equal(quantized->forward(x), served));
}
