// fulgur::nn::Linear (SDK 1.3, #38 item 3): a drop-in for torch::nn::Linear whose weight can be
// stored int8 per channel or int4 per group, checked against torch::nn::Linear, hand-computed
// quantized values and the dequantized matmul; quantized state dicts round-trip through
// safetensors into a fresh model.
#include <fulgur/error.h>
#include <fulgur/nn/linear.h>
#include <fulgur/weights.h>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include "test_support.h"

namespace {

using fulgur::nn::QuantizeOptions;
using fulgur::nn::WeightQuantization;
using fulgur::test::contains;
using fulgur::test::error_from;
using fulgur::test::TempDir;

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    fc1 = register_module("fc1", fulgur::nn::Linear(64, 32));
    fc2 = register_module("fc2", fulgur::nn::Linear(32, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  fulgur::nn::Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace

TEST_CASE("#38.3 fulgur::nn::Linear unquantized is torch::nn::Linear: same draws, names, bits") {
  torch::manual_seed(11);
  torch::nn::Linear reference(torch::nn::LinearOptions(48, 24));
  torch::manual_seed(11);
  fulgur::nn::Linear ours(48, 24);
  CHECK(torch::equal(ours->weight, reference->weight));
  CHECK(torch::equal(ours->bias, reference->bias));
  CHECK((ours->named_parameters().keys() == reference->named_parameters().keys()));
  const at::Tensor x = torch::randn({3, 5, 48});
  CHECK(torch::equal(ours->forward(x), reference->forward(x)));
  fulgur::nn::Linear no_bias(fulgur::nn::LinearOptions(4, 2).bias(false));
  CHECK_FALSE(no_bias->bias.defined());
  CHECK(no_bias->parameters().size() == 1);
  // A clone is a separate layer with the same values.
  auto copy = std::dynamic_pointer_cast<fulgur::nn::LinearImpl>(ours->clone());
  REQUIRE(copy);
  CHECK(torch::equal(copy->weight, ours->weight));
  CHECK(copy->weight.data_ptr() != ours->weight.data_ptr());
}

TEST_CASE("#38.3 int8 weight-only: per-channel scales and values as computed by hand, output = dequantized matmul") {
  fulgur::nn::Linear layer(4, 2);
  {
    torch::NoGradGuard no_grad;
    layer->weight.copy_(torch::tensor({{1.27f, -0.635f, 0.f, 0.01f}, {-2.54f, 1.0f, 0.5f, 2.54f}}));
    layer->bias.copy_(torch::tensor({0.5f, -1.f}));
  }
  layer->quantize_weight(WeightQuantization::int8);
  CHECK((layer->quantization() == WeightQuantization::int8));
  CHECK((layer->weight.scalar_type() == at::kChar));
  const auto buffers = layer->named_buffers();
  REQUIRE(buffers.contains("weight_scale"));
  CHECK_FALSE(layer->named_parameters().contains("weight"));
  // scale = max |w| / 127: 0.01 and 0.02; values = round(w / scale).
  CHECK(torch::allclose(buffers["weight_scale"], torch::tensor({0.01f, 0.02f})));
  CHECK(torch::equal(layer->weight, torch::tensor({{127, -64, 0, 1}, {-127, 50, 25, 127}}, torch::kChar)));
  const at::Tensor x = torch::randn({6, 4});
  const at::Tensor expected = torch::matmul(x, layer->dequantized_weight().t()) + layer->bias;
  CHECK(torch::allclose(layer->forward(x), expected, 1e-5, 1e-5));
  // A quantized layer cannot be quantized again.
  CHECK(contains(error_from([&] { layer->quantize_weight(WeightQuantization::int4); }).what(), "already quantized"));
}

TEST_CASE("#38.3 int4 weight-only: group scales and zeros as computed by hand, output = dequantized matmul") {
  torch::manual_seed(3);
  fulgur::nn::Linear layer(64, 8);
  const at::Tensor w = layer->weight.detach().clone();
  layer->quantize_weight(QuantizeOptions(WeightQuantization::int4).group_size(32));
  CHECK((layer->weight.scalar_type() == at::kByte));
  CHECK(layer->weight.max().item<int>() <= 15);
  CHECK(layer->group_size() == 32);
  const auto buffers = layer->named_buffers();
  const at::Tensor scale = buffers["weight_scale"], zero = buffers["weight_zero"];
  CHECK(scale.sizes() == at::IntArrayRef({8, 2}));
  // Group 0 of row 0: min maps to code 0, max to 15, zero is the value of code 8.
  const at::Tensor group = w[0].narrow(0, 0, 32);
  const float low = group.min().item<float>(), high = group.max().item<float>();
  CHECK(scale[0][0].item<float>() == doctest::Approx((high - low) / 15).epsilon(1e-6));
  CHECK(zero[0][0].item<float>() == doctest::Approx(low + 8 * (high - low) / 15).epsilon(1e-6));
  // Dequantization error at most half a step per weight.
  const at::Tensor error = (layer->dequantized_weight() - w).abs().reshape({8, 2, 32}).amax(-1);
  CHECK((error <= scale * 0.5 + 1e-6).all().item<bool>());
  const at::Tensor x = torch::randn({5, 64});
  const at::Tensor expected = torch::matmul(x, layer->dequantized_weight().t()) + layer->bias;
  CHECK(torch::allclose(layer->forward(x), expected, 1e-5, 1e-5));
  // A 3-D input keeps its leading dimensions.
  CHECK(layer->forward(torch::randn({2, 3, 64})).sizes() == at::IntArrayRef({2, 3, 8}));
  // 784 inputs in groups of 32: the last group has 16 columns; its min and max are theirs.
  fulgur::nn::Linear odd(784, 10);
  const at::Tensor odd_w = odd->weight.detach().clone();
  odd->quantize_weight(QuantizeOptions(WeightQuantization::int4).group_size(32));
  CHECK(odd->named_buffers()["weight_scale"].size(1) == 25);
  const at::Tensor tail = odd_w.narrow(1, 768, 16);
  CHECK(odd->named_buffers()["weight_scale"][3][24].item<float>() ==
        doctest::Approx((tail[3].max() - tail[3].min()).item<float>() / 15).epsilon(1e-6));
  const at::Tensor odd_x = torch::randn({7, 784});
  CHECK(torch::allclose(odd->forward(odd_x), torch::matmul(odd_x, odd->dequantized_weight().t()) + odd->bias, 1e-5,
                        1e-5));
  // Group sizes the kernel cannot take are refused.
  fulgur::nn::Linear fresh(64, 4);
  CHECK(contains(
      error_from([&] { fresh->quantize_weight(QuantizeOptions(WeightQuantization::int4).group_size(16)); }).what(),
      "must be 32, 64, 128 or 256"));
}

TEST_CASE("#38.3 a quantized state dict round-trips through safetensors into a fresh model") {
  for (const auto method : {WeightQuantization::int8, WeightQuantization::int4}) {
    CAPTURE(fulgur::nn::to_string(method));
    TempDir dir;
    torch::manual_seed(5);
    TwoLayers trained;
    // Only fc1 (the filter); fc2 stays float.
    const auto names = fulgur::nn::quantize_linear_weights(trained, QuantizeOptions(method).group_size(32), "^fc1$");
    REQUIRE((names == std::vector<std::string>{"fc1"}));
    CHECK((trained.fc2->quantization() == WeightQuantization::none));
    std::map<std::string, std::string> metadata = {
        {fulgur::nn::kQuantizationMetadataKey, fulgur::nn::to_string(method)},
        {"fulgur.group_size", "32"},
        {"fulgur.quantized_layers", "fc1"}};
    const std::string file = (dir / "q.safetensors").string();
    fulgur::save_safetensors(fulgur::named_tensors(trained), file, metadata);

    torch::manual_seed(99);  // other initial values: only the load can make the outputs equal
    TwoLayers served;
    std::map<std::string, std::string> read_metadata;
    const fulgur::TensorMap tensors = fulgur::read_safetensors(file, &read_metadata);
    REQUIRE(fulgur::nn::prepare_quantized_layers(served, read_metadata));
    const auto report = fulgur::load_weights(served, tensors);  // strict
    CHECK(report.complete());
    const at::Tensor x = torch::randn({4, 64});
    CHECK(torch::equal(served.forward(x), trained.forward(x)));
    // Metadata without quantization: nothing to prepare.
    CHECK_FALSE(fulgur::nn::prepare_quantized_layers(served, {{"format", "pt"}}));
  }
}

TEST_CASE("#38.3 quantized weights for a layer declared as torch::nn::Linear are refused, naming it") {
  struct Plain : torch::nn::Module {
    Plain() { fc = register_module("fc", torch::nn::Linear(64, 4)); }
    torch::nn::Linear fc{nullptr};
  } plain;
  const fulgur::Error e = error_from([&] {
    fulgur::nn::prepare_quantized_layers(plain, {{"fulgur.quantization", "int8"}, {"fulgur.quantized_layers", "fc"}});
  });
  CHECK(contains(e.what(), "layer 'fc' quantized (int8)"));
  CHECK(contains(e.what(), "declare it as fulgur::nn::Linear"));
  CHECK(contains(error_from([&] {
                   fulgur::nn::prepare_quantized_layers(
                       plain, {{"fulgur.quantization", "int8"}, {"fulgur.quantized_layers", "head"}});
                 }).what(),
                 "layer 'head', which the model does not have"));
  CHECK(contains(error_from([&] { fulgur::nn::weight_quantization_from_string("int3"); }).what(),
                 "unknown weight quantization 'int3'"));
}

TEST_CASE(
    "#38.2 quantization-aware training: the forward is the quantized layer's, the gradient goes straight through") {
  for (const auto method : {WeightQuantization::int8, WeightQuantization::int4}) {
    CAPTURE(fulgur::nn::to_string(method));
    torch::manual_seed(8);
    fulgur::nn::Linear trained(784, 10);  // int4: 24 whole groups of 32 and one of 16
    trained->fake_quantize(fulgur::nn::FakeQuantizeOptions(method).group_size(32));
    CHECK((trained->fake_quantization() == method));
    const at::Tensor x = torch::randn({6, 784});
    const at::Tensor y = trained->forward(x);
    // The same layer stored quantized computes the same outputs.
    auto stored = std::dynamic_pointer_cast<fulgur::nn::LinearImpl>(trained->clone());
    stored->fake_quantize(WeightQuantization::none);
    stored->quantize_weight(QuantizeOptions(method).group_size(32));
    CHECK(torch::allclose(y, stored->forward(x), 1e-5, 1e-5));
    CHECK_FALSE(torch::allclose(y, torch::nn::functional::linear(x, trained->weight, trained->bias), 1e-4, 1e-4));
    // Straight through: the float weight's gradient is the gradient at the quantized weight.
    y.pow(2).sum().backward();
    const at::Tensor w_q = stored->dequantized_weight().requires_grad_(true);
    torch::nn::functional::linear(x, w_q, trained->bias.detach()).pow(2).sum().backward();
    CHECK(torch::allclose(trained->weight.grad(), w_q.grad(), 1e-5, 1e-4));
  }
  // A quantized layer has no float weight to train.
  fulgur::nn::Linear done(64, 4);
  done->quantize_weight(WeightQuantization::int8);
  CHECK(contains(error_from([&] { done->fake_quantize(WeightQuantization::int8); }).what(), "needs the float weight"));
}
