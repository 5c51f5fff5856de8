// #38 item 1, FP8 training: the recipe's arithmetic against values computed by hand, the CPU
// kernel against Python's torch._scaled_mm on the same operands, the layer's gradients, and the
// `fp8` precision plugin driving `fulgur fit` on the Fashion-MNIST MLP (the GPT example's FP8 runs,
// alone and under fsdp ZeRO-3, are in gpt_example_test.cpp).
#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>
#include <fulgur/nn/float8.h>
#include <fulgur/nn/linear.h>

#include <ATen/autocast_mode.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "test_support.h"

namespace {

using namespace fulgur::test;
using fulgur::nn::Float8Backend;
using fulgur::nn::Float8Options;
using fulgur::nn::Float8Scaling;

const fs::path kFashionMnist = "/usr/share/datasets/fashion-mnist";
const std::map<std::string, std::string> kEnv = {{"FULGUR_LOG_LEVEL", "info"}, {"FULGUR_PLUGIN_PATH", ""}};

std::vector<float> values_of(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  return {f.data_ptr<float>(), f.data_ptr<float>() + f.numel()};
}

// Operands both sides can build exactly: small integers over powers of two.
at::Tensor exact_operand(int64_t rows, int64_t cols, int64_t a, int64_t b, int64_t modulus, double divisor) {
  at::Tensor t = at::empty({rows, cols});
  auto acc = t.accessor<float, 2>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      acc[i][j] = static_cast<float>(static_cast<double>((i * a + j * b) % modulus - modulus / 2) / divisor);
  return t;
}

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kFloat) - want.to(at::kFloat)).norm().item<double>() / want.to(at::kFloat).norm().item<double>();
}

bool fashion_mnist_missing() {
  if (fs::exists(kFashionMnist / "t10k-images-idx3-ubyte.gz")) return false;
  skip_test("Fashion-MNIST is missing: install the Debian package dataset-fashion-mnist");
  return true;
}

}  // namespace

TEST_CASE("#38.1 FP8 recipe: amax, scale, saturation and e4m3/e5m2 round trips as computed by hand") {
  using namespace fulgur::nn;
  CHECK(float8_max(at::kFloat8_e4m3fn) == 448.0);
  CHECK(float8_max(at::kFloat8_e5m2) == 57344.0);
  CHECK(error_from([] { float8_max(at::kBFloat16); }).kind() == fulgur::ErrorKind::invalid_argument);

  // scale = max / amax, computed in float64 then rounded to float32; an all-zero tensor's amax is
  // clamped to 1e-12, so its scale is finite.
  CHECK(amax_to_scale(at::scalar_tensor(2.0), at::kFloat8_e4m3fn).item<float>() == 224.0f);
  CHECK(amax_to_scale(at::scalar_tensor(4.0), at::kFloat8_e5m2).item<float>() == 14336.0f);
  CHECK(amax_to_scale(at::scalar_tensor(3.0), at::kFloat8_e4m3fn).item<float>() == static_cast<float>(448.0 / 3.0));
  const float zero_scale = amax_to_scale(at::scalar_tensor(0.0), at::kFloat8_e4m3fn).item<float>();
  CHECK(std::isfinite(zero_scale));
  CHECK(zero_scale == static_cast<float>(448.0 / 1e-12));

  // Saturation: a plain cast turns 500 into NaN in e4m3 (no infinity there); the saturated cast
  // clamps to ±448. e5m2 clamps at ±57344.
  const at::Tensor big = at::tensor({500.0f, -500.0f, 1e6f});
  CHECK(std::isnan(big.to(at::kFloat8_e4m3fn).to(at::kFloat)[0].item<float>()));
  CHECK((values_of(to_float8_saturated(big, at::scalar_tensor(1.0f), at::kFloat8_e4m3fn)) ==
         std::vector<float>{448.0f, -448.0f, 448.0f}));
  CHECK((values_of(to_float8_saturated(big, at::scalar_tensor(1.0f), at::kFloat8_e5m2)) ==
         std::vector<float>{512.0f, -512.0f, 57344.0f}));

  // Round trips: e4m3 has 3 mantissa bits (0.3 -> 0.3125 = 1.25 * 2^-2, 1.1 -> 1.125), e5m2 has 2
  // (1.1 -> 1.0, 0.3 -> 0.3125); values on the grid come back exactly.
  const at::Tensor x = at::tensor({0.3f, 1.1f, 0.3125f, -6.0f});
  CHECK((values_of(to_float8_saturated(x, at::scalar_tensor(1.0f), at::kFloat8_e4m3fn)) ==
         std::vector<float>{0.3125f, 1.125f, 0.3125f, -6.0f}));
  CHECK((values_of(to_float8_saturated(x, at::scalar_tensor(1.0f), at::kFloat8_e5m2)) ==
         std::vector<float>{0.3125f, 1.0f, 0.3125f, -6.0f}));

  // Tensorwise: amax 4, scale 448 / 4 = 112; every scaled value is on e4m3's grid, so the
  // dequantized tensor is the original.
  const at::Tensor m = at::tensor({1.0f, -2.0f, 0.5f, 4.0f}).reshape({2, 2});
  const Float8Tensor t = quantize_float8(m, at::kFloat8_e4m3fn, Float8Scaling::tensorwise);
  CHECK(t.scale.item<float>() == 112.0f);
  CHECK((values_of(t.data) == std::vector<float>{112.0f, -224.0f, 56.0f, 448.0f}));
  CHECK(at::equal(t.dequantize(), m));
  // Rowwise along dim 1: row amaxes 2 and 4, scales 224 and 112 rounded down to powers of two (as
  // torchao's rowwise recipe): 128 and 64. Along dim 0: column amaxes 1 and 4 -> 256 and 64.
  const Float8Tensor r = quantize_float8(m, at::kFloat8_e4m3fn, Float8Scaling::rowwise, 1);
  CHECK(r.scale.sizes() == at::IntArrayRef({2, 1}));
  CHECK((values_of(r.scale) == std::vector<float>{128.0f, 64.0f}));
  CHECK((values_of(r.data) == std::vector<float>{128.0f, -256.0f, 32.0f, 256.0f}));
  const Float8Tensor c = quantize_float8(m, at::kFloat8_e4m3fn, Float8Scaling::rowwise, 0);
  CHECK(c.scale.sizes() == at::IntArrayRef({1, 2}));
  CHECK((values_of(c.scale) == std::vector<float>{256.0f, 64.0f}));
  CHECK(error_from([&] { quantize_float8(m.reshape({4}), at::kFloat8_e4m3fn, Float8Scaling::tensorwise); }).kind() ==
        fulgur::ErrorKind::invalid_argument);
  CHECK((float8_scaling_from_string("rowwise") == Float8Scaling::rowwise));
  CHECK(contains(error_from([] { float8_scaling_from_string("delayed"); }).what(), "\"tensorwise\" or \"rowwise\""));
}

TEST_CASE("#38.1 FP8 tensorwise product on the CPU kernel equals Python's torch._scaled_mm bitwise") {
  using namespace fulgur::nn;
  const at::Tensor a = exact_operand(32, 64, 37, 11, 101, 8.0);
  const at::Tensor b = exact_operand(64, 48, 13, 29, 97, 16.0);
  const Float8Tensor a8 = quantize_float8(a, at::kFloat8_e4m3fn, Float8Scaling::tensorwise, 1);
  const Float8Tensor b8 = quantize_float8(b, at::kFloat8_e5m2, Float8Scaling::tensorwise, 0);
  const at::Tensor kernel = float8_mm(a8, b8, at::kFloat, Float8Backend::scaled_mm);
  const at::Tensor emulated = float8_mm(a8, b8, at::kFloat, Float8Backend::emulated);
  // On the CPU "auto" emulates (ATen's CPU kernel is a reference loop).
  CHECK(at::equal(float8_mm(a8, b8, at::kFloat), emulated));
  // The same operand values reach both; only the summation order may differ.
  CHECK(relative_error(kernel, emulated) < 1e-6);
  CHECK(relative_error(kernel, at::matmul(a, b)) < 0.1);  // FP8's own error (e4m3 x e5m2)

  TempDir dir;
  {
    std::ofstream out(dir / "cpp.bin", std::ios::binary);
    const at::Tensor k = kernel.contiguous();
    out.write(static_cast<const char*>(k.data_ptr()), k.numel() * 4);
    const at::Tensor q = a8.data.view(at::kByte).contiguous();
    out.write(static_cast<const char*>(q.data_ptr()), q.numel());
  }
  // The recipe as torchao writes it, on operands built by the same formula.
  write_bytes(dir / "check.py", R"(import sys, torch
def operand(rows, cols, a, b, m, d):
    i = torch.arange(rows).unsqueeze(1); j = torch.arange(cols).unsqueeze(0)
    return (((i * a + j * b) % m - m // 2).double() / d).float()
def to_fp8(x, dtype):
    amax = x.abs().max().to(torch.float64)
    scale = (torch.finfo(dtype).max / torch.clamp(amax, min=1e-12)).to(torch.float32)
    m = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-m, max=m).to(dtype), scale
a8, sa = to_fp8(operand(32, 64, 37, 11, 101, 8.0), torch.float8_e4m3fn)
b8, sb = to_fp8(operand(64, 48, 13, 29, 97, 16.0), torch.float8_e5m2)
out = torch._scaled_mm(a8, b8, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
mine = out.contiguous().numpy().tobytes() + a8.view(torch.uint8).contiguous().numpy().tobytes()
theirs = open(sys.argv[1], 'rb').read()
print('bitwise equal' if mine == theirs else 'differ: max %g' % (out - torch.frombuffer(bytearray(theirs[:out.numel() * 4]), dtype=torch.float32).view(32, 48)).abs().max().item())
)");
  const auto [status, output] =
      run_command(fmt::format("{} {} {}", FULGUR_TEST_PYTHON, (dir / "check.py").string(), (dir / "cpp.bin").string()));
  INFO(output);
  REQUIRE(status == 0);
  CHECK(contains(output, "bitwise equal"));
}

TEST_CASE("#38.1 float8_linear: outputs and gradients within FP8's error of float32, the CPU kernel equals emulation") {
  using namespace fulgur::nn;
  torch::manual_seed(11);
  const at::Tensor x0 = torch::randn({4, 8, 64});
  const at::Tensor w0 = torch::randn({32, 64}) * 0.1;
  const at::Tensor b0 = torch::randn({32});
  const auto run = [&](const Float8Options* options) {
    at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    at::Tensor y = options ? float8_linear(x, w, b, *options) : at::linear(x, w, b);
    (y * y.detach().sin()).sum().backward();  // a gradient that differs per element
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  const auto reference = run(nullptr);
  for (const Float8Scaling scaling : {Float8Scaling::tensorwise, Float8Scaling::rowwise}) {
    CAPTURE(to_string(scaling));
    const Float8Options automatic(scaling), emulated_options = Float8Options(scaling).backend(Float8Backend::emulated);
    const auto result = run(&automatic);
    const auto emulated = run(&emulated_options);
    REQUIRE(result[0].sizes() == at::IntArrayRef({4, 8, 32}));
    for (size_t i = 0; i < reference.size(); ++i) {
      CAPTURE(i);
      // e4m3 rounds to 2^-4 relative at worst; over 64-term sums the relative error is ~2-4%, and
      // e5m2 gradients add ~6%.
      CHECK(relative_error(result[i], reference[i]) < (i == 0 ? 0.05 : 0.1));
      CHECK(relative_error(result[i], reference[i]) > 0.0);  // FP8 did run
      CHECK(at::equal(result[i], emulated[i]));              // "auto" emulates on the CPU
    }
    // The bias gradient is the output gradient's sum, in high precision.
    CHECK(relative_error(result[3], reference[3]) < 0.05);
    if (scaling == Float8Scaling::tensorwise) {
      // ATen's CPU kernel takes tensorwise scales: the same values, summed in another order.
      const Float8Options kernel_options = Float8Options(scaling).backend(Float8Backend::scaled_mm);
      const auto kernel = run(&kernel_options);
      for (size_t i = 0; i < reference.size(); ++i) CHECK(relative_error(kernel[i], emulated[i]) < 1e-6);
    } else {
      // It refuses rowwise scales: forced, that is an error naming the fix.
      const Float8Options kernel_options = Float8Options(scaling).backend(Float8Backend::scaled_mm);
      const fulgur::Error refused = error_from([&] { run(&kernel_options); });
      CHECK(refused.kind() == fulgur::ErrorKind::invalid_argument);
      CHECK(contains(refused.what(), "at::_scaled_mm refused rowwise scaling"));
      CHECK(contains(refused.what(), "use backend \"auto\" or \"emulated\""));
    }
  }
  // Under bf16 autocast the output is bfloat16, as at::linear's would be.
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    const at::Tensor y = float8_linear(x0, w0, b0, Float8Options());
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    CHECK((y.scalar_type() == at::kBFloat16));
  }
}

TEST_CASE("#38.1 fulgur::nn::Linear in FP8: a mode of the layer, chosen by size and filter, exclusive with QAT") {
  using namespace fulgur::nn;
  torch::nn::Sequential model;
  model->push_back("fc1", Linear(64, 32));
  model->push_back("fc2", Linear(32, 10));  // 10 outputs: not a multiple of 16
  model->push_back("head", Linear(32, 32));
  CHECK((convert_to_float8_training(*model, Float8Options(), "^(?!head)") == std::vector<std::string>{"fc1"}));
  auto fc1 = model->named_children()["fc1"]->as<Linear>();
  CHECK((fc1->float8_options().scaling() == Float8Scaling::tensorwise));
  CHECK(contains(c10::str(*fc1), "float8=tensorwise"));
  // The forward goes through the FP8 path: not at::linear's bits, within FP8's error.
  const at::Tensor x = torch::randn({8, 64});
  const at::Tensor fp8 = fc1->forward(x);
  const at::Tensor exact = at::linear(x, fc1->weight, fc1->bias);
  CHECK_FALSE(at::equal(fp8, exact));
  CHECK(relative_error(fp8, exact) < 0.05);
  // Idempotent; and off again.
  CHECK(convert_to_float8_training(*model, Float8Options(Float8Scaling::rowwise), "^fc") ==
        std::vector<std::string>{"fc1"});
  CHECK((fc1->float8_options().scaling() == Float8Scaling::rowwise));
  convert_to_float8_training(*model, Float8Options(Float8Scaling::none));
  CHECK(at::equal(fc1->forward(x), exact));

  auto fc2 = model->named_children()["fc2"]->as<Linear>();
  CHECK(contains(error_from([&] { fc2->float8_training(Float8Options()); }).what(), "multiples of 16"));
  fc1->fake_quantize(FakeQuantizeOptions(WeightQuantization::int8));
  CHECK(contains(error_from([&] { fc1->float8_training(Float8Options()); }).what(), "exclusive"));
  fc1->fake_quantize(FakeQuantizeOptions(WeightQuantization::none));
  fc1->float8_training(Float8Options());
  CHECK(contains(error_from([&] { fc1->fake_quantize(FakeQuantizeOptions(WeightQuantization::int8)); }).what(),
                 "exclusive"));
  // Quantizing for serving ends FP8 training.
  fc1->quantize_weight(QuantizeOptions(WeightQuantization::int8));
  CHECK((fc1->float8_options().scaling() == Float8Scaling::none));
  CHECK(contains(error_from([&] { fc1->float8_training(Float8Options()); }).what(), "quantized"));
}

TEST_CASE("#38.1 precision fp8: the Fashion-MNIST MLP trains within 1 point of bf16-mixed, bad options refused") {
  if (fashion_mnist_missing()) return;
  TempDir dir;
  const auto config = [&](const std::string& root, const std::string& precision) {
    return fmt::format(
        "[trainer]\nmax_epochs = 1\nseed = 5\nlimit_train_batches = 300\nlimit_val_batches = 2\n"
        "limit_test_batches = 40\nprecision = \"{}\"\nenable_progress_bar = false\nenable_model_summary = "
        "false\ndefault_root_dir = \"{}\"\n\n"
        "[model]\nname = \"fashion_mnist_mlp\"\n\n[data]\nname = \"fashion_mnist\"\ndir = \"{}\"\n"
        "batch_size = 64\n\n[[callbacks]]\nname = \"model_checkpoint\"\nsave_last = true\n",
        precision, (dir / root).string(), kFashionMnist.string());
  };
  const auto fit_and_test = [&](const std::string& root, const std::string& precision, const std::string& extra) {
    write_bytes(dir / "run.toml", config(root, precision) + extra);
    const ProcessRun fit = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"}, kEnv, dir.path());
    REQUIRE_MESSAGE(fit.exit_code == 0, fit.output);
    std::string last;
    for (const auto& entry : fs::recursive_directory_iterator(dir / root))
      if (entry.path().filename() == "last.ckpt") last = entry.path().string();
    const ProcessRun test =
        run_process({FULGUR_TEST_FULGUR_BIN, "test", "--config", "run.toml", "--ckpt_path=" + last}, kEnv, dir.path());
    REQUIRE_MESSAGE(test.exit_code == 0, test.output);
    const size_t at = test.output.find("test/acc");
    REQUIRE_MESSAGE(at != std::string::npos, test.output);
    return std::make_pair(fit.output, std::stod(test.output.substr(test.output.find_first_not_of(' ', at + 8))));
  };
  const auto [bf16_log, bf16] = fit_and_test("bf16", "bf16-mixed", "");
  const auto [fp8_log, fp8] = fit_and_test("fp8", "fp8", "");
  const auto [rowwise_log, rowwise] = fit_and_test("rowwise", "fp8", "\n[precision]\nscaling = \"rowwise\"\n");
  MESSAGE("test accuracy after 300 steps: bf16-mixed " << bf16 << ", fp8 tensorwise " << fp8 << ", fp8 rowwise "
                                                       << rowwise);
  // fc1 (784 -> 256) trains in FP8; fc2 (256 -> 10 classes) is not a multiple of 16 and stays bf16.
  FULGUR_CHECK_CONTAINS(fp8_log, "fp8: 1 linear layers train in FP8 (tensorwise scaling): fc1; left in bf16: fc2");
  FULGUR_CHECK_CONTAINS(rowwise_log, "(rowwise scaling): fc1");
  CHECK(std::abs(fp8 - bf16) <= 0.01);
  CHECK(std::abs(rowwise - bf16) <= 0.01);
  CHECK(fp8 > 0.75);

  // autocast = false keeps the layers outside FP8 in float32; a named backend is said in the log.
  write_bytes(dir / "run.toml", config("float32", "fp8") + "\n[precision]\nautocast = false\nbackend = \"emulated\"\n");
  const ProcessRun float32_rest = run_process(
      {FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml", "--trainer.limit_train_batches=5"}, kEnv, dir.path());
  REQUIRE_MESSAGE(float32_rest.exit_code == 0, float32_rest.output);
  FULGUR_CHECK_CONTAINS(float32_rest.output,
                        "fp8: 1 linear layers train in FP8 (tensorwise scaling, backend emulated): fc1; left in "
                        "float32: fc2");

  // Bad options: what, which plugin, how to fix.
  write_bytes(dir / "run.toml", config("bad", "fp8") + "\n[precision]\nscaling = \"delayed\"\n");
  ProcessRun bad = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"}, kEnv, dir.path());
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output, "unknown FP8 scaling 'delayed'");
  write_bytes(dir / "run.toml", config("bad", "fp8") + "\n[precision]\nfilter = \"^nothing$\"\n");
  bad = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"}, kEnv, dir.path());
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output,
                        "precision 'fp8': no layer trains in FP8: the model has no fulgur::nn::Linear layer matching "
                        "filter '^nothing$'");
  write_bytes(dir / "run.toml", config("bad", "fp8") + "\n[precision]\nbackend = \"fast\"\n");
  bad = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"}, kEnv, dir.path());
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output, "unknown FP8 backend 'fast': use \"auto\", \"scaled_mm\" or \"emulated\"");
  write_bytes(dir / "run.toml", config("bad", "fp8") + "\n[precision]\nfilter = \"([\"\n");
  bad = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"}, kEnv, dir.path());
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output, "is not a valid regex");
}
