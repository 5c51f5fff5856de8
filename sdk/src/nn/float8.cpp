// FP8 training of linear layers: torchao's dynamic-scaling recipes (tensorwise, rowwise) on
// at::_scaled_mm, emulated where the device's kernel cannot take the scales or sizes.
#include <fulgur/error.h>
#include <fulgur/log.h>
#include <fulgur/nn/float8.h>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>

namespace fulgur::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr at::ScalarType kForwardDtype = at::kFloat8_e4m3fn;  // activations and weights: precision
constexpr at::ScalarType kGradientDtype = at::kFloat8_e5m2;   // gradients: range

// Autocast off for the duration of a scope: the recipe's own casts decide every dtype, and an
// emulated product must run in float32 even inside a bf16 autocast region.
class AutocastOff {
 public:
  explicit AutocastOff(c10::DeviceType device_type)
      : device_type_(device_type), was_enabled_(at::autocast::is_autocast_enabled(device_type)) {
    if (was_enabled_) at::autocast::set_autocast_enabled(device_type_, false);
  }
  ~AutocastOff() {
    if (was_enabled_) at::autocast::set_autocast_enabled(device_type_, true);
  }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  c10::DeviceType device_type_;
  bool was_enabled_;
};

// A kernel that refused a combination once (an older GPU, a dtype pairing the build lacks) is not
// tried again: the product is emulated from then on, said once in the log.
std::atomic<bool> rowwise_kernel_refused{false};
std::atomic<bool> tensorwise_kernel_refused{false};

bool is_tensorwise(const Float8Tensor& t) { return t.scale.numel() == 1; }

Float8Tensor transposed(const Float8Tensor& t) { return {t.data.t(), t.scale.dim() == 0 ? t.scale : t.scale.t()}; }

// The reduced dimension's amax with keepdim, or the whole tensor's.
at::Tensor amax_of(const at::Tensor& x, Float8Scaling scaling, int64_t reduced_dim) {
  if (scaling == Float8Scaling::tensorwise) return x.abs().max();
  return std::get<0>(x.abs().max(reduced_dim, /*keepdim=*/true));
}

// torchao's rowwise recipe rounds scales down to powers of two, so that scaling is exact in the
// exponent and the cast loses nothing to the scale's own rounding.
at::Tensor scale_for(const at::Tensor& amax, at::ScalarType dtype, Float8Scaling scaling) {
  at::Tensor scale = amax_to_scale(amax, dtype);
  if (scaling == Float8Scaling::rowwise) scale = at::exp2(at::floor(at::log2(scale)));
  return scale;
}

struct Float8LinearFunction : torch::autograd::Function<Float8LinearFunction> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t scaling_value, int64_t backend_value,
                            int64_t out_dtype_value) {
    const auto scaling = static_cast<Float8Scaling>(scaling_value);
    const auto out_dtype = static_cast<at::ScalarType>(out_dtype_value);
    const auto backend = static_cast<Float8Backend>(backend_value);
    AutocastOff autocast_off(input.device().type());
    // x [M, K] summed over K; Wᵀ [K, N] summed over K: W [N, K] is scaled along its dim 1.
    const Float8Tensor x8 = quantize_float8(input, kForwardDtype, scaling, 1);
    const Float8Tensor w8 = quantize_float8(weight, kForwardDtype, scaling, 1);
    at::Tensor out = float8_mm(x8, transposed(w8), out_dtype, backend);
    if (bias.defined()) out = out + bias.to(out_dtype);
    context->saved_data["scaling"] = scaling_value;
    context->saved_data["backend"] = backend_value;
    context->saved_data["input_dtype"] = static_cast<int64_t>(input.scalar_type());
    context->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    context->saved_data["bias_dtype"] =
        static_cast<int64_t>(bias.defined() ? bias.scalar_type() : weight.scalar_type());
    context->saved_data["has_bias"] = bias.defined();
    if (scaling == Float8Scaling::tensorwise) {
      // One scale per tensor serves every product: keep the FP8 copies (a quarter of float32's bytes).
      context->save_for_backward({x8.data, x8.scale, w8.data, w8.scale});
    } else {
      // Rowwise scales follow the summed dimension, which differs in the backward: re-quantize then.
      context->save_for_backward({input, weight});
    }
    return out;
  }

  static variable_list backward(AutogradContext* context, variable_list gradients) {
    const auto scaling = static_cast<Float8Scaling>(context->saved_data["scaling"].toInt());
    const auto backend = static_cast<Float8Backend>(context->saved_data["backend"].toInt());
    const auto input_dtype = static_cast<at::ScalarType>(context->saved_data["input_dtype"].toInt());
    const auto weight_dtype = static_cast<at::ScalarType>(context->saved_data["weight_dtype"].toInt());
    const auto bias_dtype = static_cast<at::ScalarType>(context->saved_data["bias_dtype"].toInt());
    const bool has_bias = context->saved_data["has_bias"].toBool();
    const variable_list saved = context->get_saved_variables();
    const at::Tensor& grad_out = gradients[0];
    AutocastOff autocast_off(grad_out.device().type());

    Float8Tensor x_for_weight, w_for_input, dy_for_input, dy_for_weight;
    if (scaling == Float8Scaling::tensorwise) {
      const Float8Tensor x8{saved[0], saved[1]}, w8{saved[2], saved[3]};
      const Float8Tensor dy8 = quantize_float8(grad_out, kGradientDtype, scaling, 1);
      x_for_weight = x8;
      w_for_input = w8;
      dy_for_input = dy8;
      dy_for_weight = transposed(dy8);
    } else {
      const at::Tensor& input = saved[0];
      const at::Tensor& weight = saved[1];
      // dX = dY [M, N] · W [N, K], summed over N; dW = dYᵀ [N, M] · X [M, K], summed over M.
      dy_for_input = quantize_float8(grad_out, kGradientDtype, scaling, 1);
      w_for_input = quantize_float8(weight, kForwardDtype, scaling, 0);
      dy_for_weight = transposed(quantize_float8(grad_out, kGradientDtype, scaling, 0));
      x_for_weight = quantize_float8(input, kForwardDtype, scaling, 0);
    }
    at::Tensor grad_input = float8_mm(dy_for_input, w_for_input, input_dtype, backend);
    // The weight's gradient in the master weight's dtype (it accumulates into its .grad).
    at::Tensor grad_weight = float8_mm(dy_for_weight, x_for_weight, weight_dtype, backend);
    at::Tensor grad_bias = has_bias ? grad_out.to(at::kFloat).sum(0).to(bias_dtype) : at::Tensor();
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::string to_string(Float8Scaling scaling) {
  switch (scaling) {
    case Float8Scaling::none:
      return "none";
    case Float8Scaling::tensorwise:
      return "tensorwise";
    case Float8Scaling::rowwise:
      return "rowwise";
  }
  return "unknown";
}

Float8Scaling float8_scaling_from_string(const std::string& name) {
  if (name == "tensorwise") return Float8Scaling::tensorwise;
  if (name == "rowwise") return Float8Scaling::rowwise;
  if (name == "none") return Float8Scaling::none;
  throw Error(ErrorKind::config,
              fmt::format("unknown FP8 scaling '{}': use \"tensorwise\" or \"rowwise\" (or \"none\")", name));
}

std::string to_string(Float8Backend backend) {
  switch (backend) {
    case Float8Backend::automatic:
      return "auto";
    case Float8Backend::scaled_mm:
      return "scaled_mm";
    case Float8Backend::emulated:
      return "emulated";
  }
  return "unknown";
}

Float8Backend float8_backend_from_string(const std::string& name) {
  if (name == "auto") return Float8Backend::automatic;
  if (name == "scaled_mm") return Float8Backend::scaled_mm;
  if (name == "emulated") return Float8Backend::emulated;
  throw Error(ErrorKind::config,
              fmt::format("unknown FP8 backend '{}': use \"auto\", \"scaled_mm\" or \"emulated\"", name));
}

double float8_max(at::ScalarType float8_dtype) {
  if (float8_dtype == at::kFloat8_e4m3fn) return 448.0;
  if (float8_dtype == at::kFloat8_e5m2) return 57344.0;
  throw Error(ErrorKind::invalid_argument,
              fmt::format("float8_max: {} is not an FP8 format (use Float8_e4m3fn or Float8_e5m2)",
                          c10::toString(float8_dtype)));
}

at::Tensor amax_to_scale(const at::Tensor& amax, at::ScalarType float8_dtype) {
  // In float64, then float32, as torchao: the scale of a tiny amax stays finite and exact.
  return (float8_max(float8_dtype) / amax.to(at::kDouble).clamp_min(1e-12)).to(at::kFloat);
}

at::Tensor to_float8_saturated(const at::Tensor& x, const at::Tensor& scale, at::ScalarType float8_dtype) {
  const double limit = float8_max(float8_dtype);
  return (x.to(at::kFloat) * scale).clamp(-limit, limit).to(float8_dtype);
}

at::Tensor Float8Tensor::dequantize() const {
  // Multiplied by the reciprocal, as at::_scaled_mm applies it, so emulation sees the kernel's values.
  return data.to(at::kFloat) * scale.reciprocal();
}

Float8Tensor quantize_float8(const at::Tensor& x, at::ScalarType float8_dtype, Float8Scaling scaling,
                             int64_t reduced_dim) {
  if (x.dim() != 2)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("quantize_float8: expected a 2-D tensor, got {} dimensions", x.dim()));
  if (scaling == Float8Scaling::none)
    throw Error(ErrorKind::invalid_argument, "quantize_float8: scaling none quantizes nothing");
  const at::Tensor scale = scale_for(amax_of(x, scaling, reduced_dim), float8_dtype, scaling);
  return {to_float8_saturated(x, scale, float8_dtype), scale};
}

at::Tensor float8_mm(const Float8Tensor& a, const Float8Tensor& b, at::ScalarType out_dtype, Float8Backend backend) {
  const bool tensorwise = is_tensorwise(a) && is_tensorwise(b);
  bool kernel = backend == Float8Backend::scaled_mm;
  if (backend == Float8Backend::automatic) {
    const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(1);
    kernel =
        a.data.is_cuda() && m % 16 == 0 && k % 16 == 0 && n % 16 == 0 &&
        (tensorwise ? !tensorwise_kernel_refused.load() : out_dtype == at::kBFloat16 && !rowwise_kernel_refused.load());
  }
  if (kernel) {
    try {
      // The kernels want the left operand row-major and the right one column-major.
      return at::_scaled_mm(a.data.contiguous(), b.data.t().contiguous().t(), a.scale.reciprocal(),
                            b.scale.reciprocal(), /*bias=*/{}, /*scale_result=*/{}, out_dtype);
    } catch (const c10::Error& e) {
      const std::string what =
          fmt::format("at::_scaled_mm refused {} scaling of [{}] x [{}] on {} ({})",
                      tensorwise ? "tensorwise" : "rowwise", fmt::join(a.data.sizes(), ", "),
                      fmt::join(b.data.sizes(), ", "), a.data.device().str(), e.what_without_backtrace());
      if (backend == Float8Backend::scaled_mm)
        throw Error(ErrorKind::invalid_argument, fmt::format("FP8: {}; use backend \"auto\" or \"emulated\"", what));
      std::atomic<bool>& refused = tensorwise ? tensorwise_kernel_refused : rowwise_kernel_refused;
      if (!refused.exchange(true)) log::warn(fmt::format("FP8: {}; emulating it from now on", what));
    }
  }
  return at::matmul(a.dequantize(), b.dequantize()).to(out_dtype);
}

at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const Float8Options& options) {
  if (options.scaling() == Float8Scaling::none) return at::linear(input, weight, bias);
  if (weight.dim() != 2 || input.dim() < 1 || input.size(-1) != weight.size(1))
    throw Error(ErrorKind::invalid_argument, fmt::format("float8_linear: input [..., {}] does not fit weight [{}]",
                                                         input.size(-1), fmt::join(weight.sizes(), ", ")));
  const c10::DeviceType device_type = input.device().type();
  const at::ScalarType out_dtype = at::autocast::is_autocast_enabled(device_type)
                                       ? at::autocast::get_autocast_dtype(device_type)
                                       : input.scalar_type();
  const auto leading = input.sizes().slice(0, input.dim() - 1);
  const at::Tensor flat = input.reshape({-1, input.size(-1)});
  const at::Tensor out =
      Float8LinearFunction::apply(flat, weight, bias, static_cast<int64_t>(options.scaling()),
                                  static_cast<int64_t>(options.backend()), static_cast<int64_t>(out_dtype));
  std::vector<int64_t> shape(leading.begin(), leading.end());
  shape.push_back(weight.size(0));
  return out.reshape(shape);
}

bool float8_compatible(int64_t in_features, int64_t out_features) {
  return in_features > 0 && out_features > 0 && in_features % 16 == 0 && out_features % 16 == 0;
}

}  // namespace fulgur::nn
