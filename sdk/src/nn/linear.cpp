// fulgur::nn::Linear: torch::nn::Linear's computation, plus weight-only int8/int4 storage served
// by ATen's weight-only kernels.
#include <fulgur/error.h>
#include <fulgur/nn/linear.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <regex>
#include <sstream>
#include <utility>

namespace fulgur::nn {

struct LinearImpl::State {
  WeightQuantization quantization = WeightQuantization::none;
  int64_t group_size = 0;
  WeightQuantization fake = WeightQuantization::none;  // quantization-aware training
  int64_t fake_group_size = 0;
  at::Tensor scale;  // int8: [out]; int4: [out, in / group]
  at::Tensor zero;   // int4: [out, in / group]
  // int4 on the CPU: the kernel's packed layout and its [in / group, out, 2] scales and zeros, made
  // at the first forward from the unpacked buffers (a load replaces those: the key notices).
  at::Tensor packed;
  at::Tensor scales_and_zeros;
  const void* packed_from = nullptr;
  uint32_t packed_version = 0;
  Float8Options float8{Float8Scaling::none};  // FP8 training (SDK 1.4)
  // Quantization-aware training of the input and learned scales (SDK 1.5). The learned tensors are
  // the layer's registered parameters (weight_scale, weight_zero, input_scale, input_zero).
  ActivationQuantization activations = ActivationQuantization::none;
  bool learnable = false;
  at::Tensor learned_scale, learned_zero;  // int8: [out]; int4: [out, groups] both
  at::Tensor input_scale, input_zero;      // per_tensor: [1] each
  bool input_ready = false;                // input_scale checked for its data initialization
  // Set by the copy constructor: the reset() that torch::nn::Cloneable::clone calls next (with the
  // copy's parameters and buffers cleared) registers this layer's own set again, not a float one.
  bool copied = false;
};

std::string to_string(WeightQuantization quantization) {
  switch (quantization) {
    case WeightQuantization::none:
      return "none";
    case WeightQuantization::int8:
      return "int8";
    case WeightQuantization::int4:
      return "int4";
  }
  return "unknown";
}

std::string to_string(ActivationQuantization quantization) {
  switch (quantization) {
    case ActivationQuantization::none:
      return "none";
    case ActivationQuantization::per_token:
      return "per_token";
    case ActivationQuantization::per_tensor:
      return "per_tensor";
  }
  return "unknown";
}

ActivationQuantization activation_quantization_from_string(const std::string& name) {
  if (name == "none") return ActivationQuantization::none;
  if (name == "per_token") return ActivationQuantization::per_token;
  if (name == "per_tensor") return ActivationQuantization::per_tensor;
  throw Error(ErrorKind::config, fmt::format("unknown activation quantization '{}': use \"none\", \"per_token\" or "
                                             "\"per_tensor\"",
                                             name));
}

WeightQuantization weight_quantization_from_string(const std::string& name) {
  if (name == "int8") return WeightQuantization::int8;
  if (name == "int4") return WeightQuantization::int4;
  if (name == "none") return WeightQuantization::none;
  throw Error(ErrorKind::config, fmt::format("unknown weight quantization '{}': use \"int8\" or \"int4\"", name));
}

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_), state_(std::make_unique<State>()) {
  reset();
}

LinearImpl::LinearImpl(const LinearImpl& other)
    : torch::nn::Cloneable<LinearImpl>(other),
      options(other.options),
      weight(other.weight),
      bias(other.bias),
      state_(std::make_unique<State>(*other.state_)) {
  state_->copied = true;
}

LinearImpl& LinearImpl::operator=(const LinearImpl& other) {
  if (this == &other) return *this;
  torch::nn::Cloneable<LinearImpl>::operator=(other);
  options = other.options;
  weight = other.weight;
  bias = other.bias;
  *state_ = *other.state_;
  state_->copied = false;
  return *this;
}

LinearImpl::~LinearImpl() = default;

void LinearImpl::reset() {
  if (options.in_features() < 1 || options.out_features() < 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("fulgur::nn::Linear: in_features and out_features must be at least 1, got {} and {}",
                            options.in_features(), options.out_features()));
  if (std::exchange(state_->copied, false) && parameters_.is_empty() && buffers(/*recurse=*/false).empty()) {
    // clone(): the copy's members still point at the original's tensors. The same names, kinds,
    // shapes and dtypes again (quantized storage, learned scales), in the original's order, as new
    // tensors; clone() then copies each one's values in by name.
    State& s = *state_;
    const auto fresh = [](const at::Tensor& t) { return t.defined() ? at::empty_like(t) : at::Tensor(); };
    const auto parameter = [&](const char* name, const at::Tensor& t) {
      return register_parameter(name, fresh(t), t.defined() && t.requires_grad());
    };
    const at::Tensor old_weight = weight;
    if (s.quantization == WeightQuantization::none) {
      weight = parameter("weight", old_weight);
      bias = parameter("bias", bias);
      if (s.learned_scale.defined()) s.learned_scale = parameter("weight_scale", s.learned_scale);
      if (s.learned_zero.defined()) s.learned_zero = parameter("weight_zero", s.learned_zero);
      if (s.input_scale.defined()) {
        s.input_scale = parameter("input_scale", s.input_scale);
        s.input_zero = parameter("input_zero", s.input_zero);
      }
    } else {
      bias = parameter("bias", bias);
      if (s.input_scale.defined()) {
        s.input_scale = register_buffer("input_scale", fresh(s.input_scale));
        s.input_zero = register_buffer("input_zero", fresh(s.input_zero));
      }
      weight = register_buffer("weight", fresh(old_weight));
      s.scale = register_buffer("weight_scale", fresh(s.scale));
      if (s.zero.defined()) s.zero = register_buffer("weight_zero", fresh(s.zero));
    }
    // The packed kernel layout is made again from the copy's own buffers at its first forward.
    s.packed = s.scales_and_zeros = at::Tensor();
    s.packed_from = nullptr;
    s.packed_version = 0;
    return;
  }
  *state_ = State{};
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias())
    bias = register_parameter("bias", torch::empty({options.out_features()}));
  else
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void LinearImpl::reset_parameters() {
  if (state_->quantization != WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument,
                "fulgur::nn::Linear::reset_parameters: the weight is quantized; reset() makes it float again");
  // torch::nn::LinearImpl::reset_parameters, draw for draw: the same seed gives the same weights.
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    auto [fan_in, fan_out] = torch::nn::init::_calculate_fan_in_and_fan_out(weight);
    const double bound = 1 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

namespace {

void check_group_size(int64_t group_size) {
  if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != 256)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("fulgur::nn::Linear: int4 group_size must be 32, 64, 128 or 256, got {}", group_size));
}

int64_t group_count(int64_t in_features, int64_t group_size) { return (in_features + group_size - 1) / group_size; }

// [rows, columns] → [rows, to] with `value` in the new columns (none when to == columns).
at::Tensor pad_columns(const at::Tensor& t, int64_t to, double value) {
  return to == t.size(1) ? t : at::constant_pad_nd(t, {0, to - t.size(1)}, value);
}

}  // namespace

void LinearImpl::prepare_quantized(const QuantizeOptions& q) {
  if (q.method() == WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument, "fulgur::nn::Linear: nothing to prepare for WeightQuantization::none");
  if (state_->quantization != WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument, fmt::format("fulgur::nn::Linear: the weight is already quantized ({})",
                                                         to_string(state_->quantization)));
  const int64_t out = options.out_features(), in = options.in_features();
  const at::Device device = weight.device();
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
  // The input's quantization stays with the served layer (torchao's converted 8da4w layers quantize
  // their input too): learned per-tensor scales become buffers; the weight's learned scales go.
  const ActivationQuantization activations = state_->activations;
  const at::Tensor input_scale = state_->input_scale.defined() ? state_->input_scale.detach().clone() : at::Tensor();
  const at::Tensor input_zero = state_->input_zero.defined() ? state_->input_zero.detach().clone() : at::Tensor();
  drop_learned_scales();
  state_->activations = activations;
  if (input_scale.defined()) {
    state_->input_scale = register_buffer("input_scale", input_scale);
    state_->input_zero = register_buffer("input_zero", input_zero);
    state_->input_ready = true;
  }
  if (parameters_.contains("weight")) parameters_.erase("weight");
  if (q.method() == WeightQuantization::int8) {
    weight = register_buffer("weight", at::zeros({out, in}, at::TensorOptions().dtype(at::kChar).device(device)));
    state_->scale = register_buffer("weight_scale", at::zeros({out}, floats));
    state_->group_size = 0;
  } else {
    check_group_size(q.group_size());
    const int64_t groups = group_count(in, q.group_size());
    weight = register_buffer("weight", at::zeros({out, in}, at::TensorOptions().dtype(at::kByte).device(device)));
    state_->scale = register_buffer("weight_scale", at::zeros({out, groups}, floats));
    state_->zero = register_buffer("weight_zero", at::zeros({out, groups}, floats));
    state_->group_size = q.group_size();
  }
  state_->quantization = q.method();
  state_->packed = at::Tensor();
}

namespace {

struct QuantizedWeight {
  at::Tensor values, scale, zero;  // zero: int4 only
};

// The storage quantize_weight makes from the float weight `w` [out, in] (see the header).
QuantizedWeight quantize(const at::Tensor& w, WeightQuantization method, int64_t group_size) {
  QuantizedWeight q;
  if (method == WeightQuantization::int8) {
    // Symmetric per output channel; an all-zero row keeps scale 1 (any scale represents it).
    q.scale = w.abs().amax(1) / 127.0;
    q.scale = at::where(q.scale > 0, q.scale, at::ones_like(q.scale));
    q.values = at::clamp(at::round(w / q.scale.unsqueeze(1)), -128, 127).to(at::kChar);
    return q;
  }
  // Asymmetric per group: min maps to 0, max to 15; zero is the value code 8 stands for. A last
  // group cut short by in_features takes its min and max over the columns it has.
  const int64_t out = w.size(0), in = w.size(1);
  const int64_t groups = group_count(in, group_size), padded = groups * group_size;
  const auto grouped = [&](double fill) { return pad_columns(w, padded, fill).reshape({out, groups, group_size}); };
  const at::Tensor low = grouped(INFINITY).amin(-1), high = grouped(-INFINITY).amax(-1);
  q.scale = (high - low) / 15.0;
  q.scale = at::where(q.scale > 0, q.scale, at::ones_like(q.scale));
  q.zero = low + q.scale * 8.0;
  q.values = at::clamp(at::round((grouped(0.0) - low.unsqueeze(-1)) / q.scale.unsqueeze(-1)), 0, 15)
                 .to(at::kByte)
                 .reshape({out, padded})
                 .narrow(1, 0, in)
                 .contiguous();
  return q;
}

// The float weight the storage stands for (int8: values * scale; int4: (values - 8) * scale + zero).
at::Tensor dequantize(const at::Tensor& values, const at::Tensor& scale, const at::Tensor& zero, int64_t group_size) {
  if (!zero.defined()) return values.to(at::kFloat) * scale.unsqueeze(1);
  const int64_t out = values.size(0), in = values.size(1);
  const int64_t groups = scale.size(1), padded = groups * group_size;
  const at::Tensor grouped = pad_columns(values.to(at::kFloat), padded, 8.0).reshape({out, groups, group_size});
  return ((grouped - 8.0) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape({out, padded}).narrow(1, 0, in);
}

// int8 codes of the activations: -128..127.
constexpr double kActMin = -128, kActMax = 127;

// torchao's (torch.ao's) choose_qparams_per_token_asymmetric, from XNNPACK, for the ranges `low` and
// `high` (broadcast): the range widened to hold 0, scale = range / 255 (at least float epsilon),
// an integer zero point chosen from the end with the smaller rounding error.
std::pair<at::Tensor, at::Tensor> asymmetric_int8_qparams(const at::Tensor& low, const at::Tensor& high) {
  const at::Tensor lo = at::clamp_max(low, 0.0), hi = at::clamp_min(high, 0.0);
  const at::Tensor scale = ((hi - lo) / (kActMax - kActMin)).clamp_min(std::numeric_limits<float>::epsilon());
  const at::Tensor descaled_min = lo / scale, descaled_max = hi / scale;
  const at::Tensor zero_point =
      at::where((kActMin + descaled_min) + (kActMax + descaled_max) > 0, kActMin - descaled_min, kActMax - descaled_max)
          .clamp(kActMin, kActMax)
          .round();
  return {scale, zero_point};
}

// `x` quantized to int8 with `scale` and integer `zero_point` and dequantized, as torch's
// fake_quantize_per_token computes it (x · (1 / scale) + zero_point, rounded half to even); the
// gradient passes where the code was in range and is zero where it was clipped.
at::Tensor fake_quantize_int8(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero_point) {
  const at::Tensor code = at::round(x * scale.reciprocal() + zero_point);
  const at::Tensor fake = (code.clamp(kActMin, kActMax) - zero_point) * scale;
  const at::Tensor passed = x * ((code >= kActMin) & (code <= kActMax));
  // passed + (fake - passed) is fake exactly: the two are within a factor 2 of each other or one is 0.
  return passed + (fake - passed).detach();
}

// A tensor with `t`'s value whose gradient is multiplied by `factor` (LSQ's gradient scale); the
// value is t's bit for bit (x·f − x·f is 0 exactly).
at::Tensor scale_gradient(const at::Tensor& t, double factor) {
  const at::Tensor scaled = t * factor;
  return t.detach() + (scaled - scaled.detach());
}

// LSQ/LSQ+: clamp(round((x − zero) / scale), low, high) · scale + zero, with the rounding straight
// through, so d/d scale = round(v) − v inside the range and the bound outside, d/d zero = 0 inside
// and 1 outside, d/d x = 1 inside and 0 outside; the scale's and zero's gradients are multiplied by
// 1 / sqrt(count · high). `zero` may be undefined (symmetric).
at::Tensor learned_fake_quantize(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero, double low,
                                 double high, int64_t count) {
  const double g = 1.0 / std::sqrt(static_cast<double>(count) * high);
  const at::Tensor s = scale_gradient(scale, g);
  const at::Tensor z = zero.defined() ? scale_gradient(zero, g) : at::Tensor();
  const at::Tensor v = ((z.defined() ? x - z : x) / s).clamp(low, high);
  const at::Tensor q = v + (at::round(v) - v).detach();
  return z.defined() ? q * s + z : q * s;
}

// The weight `w` [out, in] (float, with its graph) as the learned scales store it: int8 per output
// channel (scale [out]), int4 per group (scale and zero [out, groups], codes −8..7 around zero).
at::Tensor learned_weight(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& zero,
                          WeightQuantization method, int64_t group_size) {
  if (method == WeightQuantization::int8)
    return learned_fake_quantize(w, scale.unsqueeze(1), at::Tensor(), -128, 127, w.size(1));
  const int64_t out = w.size(0), in = w.size(1), groups = scale.size(1), padded = groups * group_size;
  const at::Tensor grouped = pad_columns(w, padded, 0.0).reshape({out, groups, group_size});
  return learned_fake_quantize(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), -8, 7, group_size)
      .reshape({out, padded})
      .narrow(1, 0, in);
}

}  // namespace

void LinearImpl::quantize_weight(const QuantizeOptions& q) {
  if (state_->quantization != WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument, fmt::format("fulgur::nn::Linear: the weight is already quantized ({})",
                                                         to_string(state_->quantization)));
  if (q.method() == WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument, "fulgur::nn::Linear::quantize_weight: choose int8 or int4");
  if (q.method() == WeightQuantization::int4) check_group_size(q.group_size());
  QuantizedWeight quantized;
  if (state_->learnable) {
    // LSQ: the storage the training saw, with the learned scales.
    const int64_t group_size = q.method() == WeightQuantization::int4 ? q.group_size() : 0;
    if (q.method() != state_->fake || group_size != state_->fake_group_size)
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("fulgur::nn::Linear::quantize_weight: the layer learned its scales for {}{}; quantize "
                      "it to that, not to {}{}",
                      to_string(state_->fake),
                      state_->fake_group_size ? fmt::format(" with group size {}", state_->fake_group_size) : "",
                      to_string(q.method()), group_size ? fmt::format(" with group size {}", group_size) : ""));
    torch::NoGradGuard no_grad;
    const at::Tensor w = weight.detach().to(at::kFloat);
    const at::Tensor scale = state_->learned_scale.detach().to(at::kFloat);
    if (q.method() == WeightQuantization::int8) {
      quantized.values = at::clamp(at::round(w / scale.unsqueeze(1)), -128, 127).to(at::kChar);
    } else {
      const at::Tensor zero = state_->learned_zero.detach().to(at::kFloat);
      const int64_t out = w.size(0), in = w.size(1), groups = scale.size(1), padded = groups * group_size;
      const at::Tensor grouped = pad_columns(w, padded, 0.0).reshape({out, groups, group_size});
      quantized.values = (at::clamp(at::round((grouped - zero.unsqueeze(-1)) / scale.unsqueeze(-1)), -8, 7) + 8)
                             .to(at::kByte)
                             .reshape({out, padded})
                             .narrow(1, 0, in)
                             .contiguous();
      quantized.zero = zero.clone();
    }
    quantized.scale = scale.clone();
  } else {
    quantized = quantize(weight.detach().to(at::kFloat), q.method(), q.group_size());
  }
  prepare_quantized(q);  // drops the learned weight scales: `quantized` holds them
  state_->fake = WeightQuantization::none;
  state_->float8 = Float8Options(Float8Scaling::none);  // a quantized layer serves; it does not train
  torch::NoGradGuard no_grad;
  weight.copy_(quantized.values);
  state_->scale.copy_(quantized.scale);
  if (quantized.zero.defined()) state_->zero.copy_(quantized.zero);
}

void LinearImpl::fake_quantize(const FakeQuantizeOptions& options) {
  if (state_->quantization != WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument,
                "fulgur::nn::Linear::fake_quantize: the weight is quantized already (quantization-aware training "
                "needs the float weight)");
  if (options.method() != WeightQuantization::none && state_->float8.scaling() != Float8Scaling::none)
    throw Error(ErrorKind::invalid_argument,
                "fulgur::nn::Linear::fake_quantize: the layer trains in FP8; quantization-aware training and FP8 "
                "training are exclusive (turn one off)");
  if (options.method() == WeightQuantization::int4) check_group_size(options.group_size());
  quantization_aware_training(QatOptions(options));
}

WeightQuantization LinearImpl::fake_quantization() const { return state_->fake; }

void LinearImpl::drop_learned_scales() {
  for (const char* name : {"weight_scale", "weight_zero", "input_scale", "input_zero"})
    if (parameters_.contains(name)) parameters_.erase(name);
  State& s = *state_;
  s.learnable = false;
  s.learned_scale = s.learned_zero = s.input_scale = s.input_zero = at::Tensor();
  s.input_ready = false;
}

void LinearImpl::quantization_aware_training(const QatOptions& qat) {
  const FakeQuantizeOptions& w = qat.weight();
  if (state_->quantization != WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument,
                "fulgur::nn::Linear::quantization_aware_training: the weight is quantized already "
                "(quantization-aware training needs the float weight)");
  if (w.method() != WeightQuantization::none && state_->float8.scaling() != Float8Scaling::none)
    throw Error(ErrorKind::invalid_argument,
                "fulgur::nn::Linear::fake_quantize: the layer trains in FP8; quantization-aware training and FP8 "
                "training are exclusive (turn one off)");
  if (w.method() == WeightQuantization::none &&
      (qat.activations() != ActivationQuantization::none || qat.learnable_scales()))
    throw Error(ErrorKind::invalid_argument,
                "fulgur::nn::Linear::quantization_aware_training: activations and learnable scales are trained "
                "together with a weight method (int8 or int4); WeightQuantization::none turns all of it off");
  if (w.method() == WeightQuantization::int4) check_group_size(w.group_size());
  State& s = *state_;
  const int64_t group_size = w.method() == WeightQuantization::int4 ? w.group_size() : 0;
  // Same storage, still learnable: keep what was learned (a second setup, a load that came first).
  const bool keep_weight =
      s.learnable && qat.learnable_scales() && s.fake == w.method() && s.fake_group_size == group_size;
  const bool keep_input =
      keep_weight && s.input_scale.defined() && qat.activations() == ActivationQuantization::per_tensor;
  if (!keep_weight) drop_learned_scales();
  s.fake = w.method();
  s.fake_group_size = group_size;
  s.activations = qat.activations();
  if (!keep_input && s.input_scale.defined()) {
    parameters_.erase("input_scale");
    parameters_.erase("input_zero");
    s.input_scale = s.input_zero = at::Tensor();
    s.input_ready = false;
  }
  if (!qat.learnable_scales() || w.method() == WeightQuantization::none) return;
  s.learnable = true;
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(weight.device());
  if (!keep_weight) {
    // Initialized from the weight: the min/max scales fixed-scale training uses.
    torch::NoGradGuard no_grad;
    const QuantizedWeight start = quantize(weight.detach().to(at::kFloat), w.method(), group_size);
    s.learned_scale = register_parameter("weight_scale", start.scale.to(floats).contiguous());
    if (start.zero.defined()) s.learned_zero = register_parameter("weight_zero", start.zero.to(floats).contiguous());
  }
  if (qat.activations() == ActivationQuantization::per_tensor && !keep_input) {
    // 0 until the first batch sets it (a checkpoint's value, loaded before, is kept).
    s.input_scale = register_parameter("input_scale", at::zeros({1}, floats));
    s.input_zero = register_parameter("input_zero", at::zeros({1}, floats));
    s.input_ready = false;
  }
}

QatOptions LinearImpl::qat_options() const {
  const State& s = *state_;
  return QatOptions(FakeQuantizeOptions(s.fake).group_size(s.fake_group_size ? s.fake_group_size : 128))
      .activations(s.activations)
      .learnable_scales(s.learnable);
}

void LinearImpl::float8_training(const Float8Options& float8) {
  if (float8.scaling() != Float8Scaling::none) {
    if (state_->quantization != WeightQuantization::none)
      throw Error(ErrorKind::invalid_argument,
                  "fulgur::nn::Linear::float8_training: the weight is quantized (FP8 training needs the float weight)");
    if (state_->fake != WeightQuantization::none)
      throw Error(ErrorKind::invalid_argument,
                  "fulgur::nn::Linear::float8_training: the layer trains with fake quantization; quantization-aware "
                  "training and FP8 training are exclusive (turn one off)");
    if (!float8_compatible(this->options.in_features(), this->options.out_features()))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("fulgur::nn::Linear::float8_training: {} -> {} features; FP8 needs both multiples of 16",
                              this->options.in_features(), this->options.out_features()));
  }
  state_->float8 = float8;
}

Float8Options LinearImpl::float8_options() const { return state_->float8; }

WeightQuantization LinearImpl::quantization() const { return state_->quantization; }
int64_t LinearImpl::group_size() const { return state_->group_size; }

at::Tensor LinearImpl::dequantized_weight() const {
  if (state_->quantization == WeightQuantization::none) return weight.detach().to(at::kFloat);
  return dequantize(weight, state_->scale, state_->zero, state_->group_size);
}

at::Tensor LinearImpl::fake_quantized_input(const at::Tensor& input) {
  State& s = *state_;
  if (s.activations == ActivationQuantization::none) return input;
  const at::Tensor x = input.to(at::kFloat);
  at::Tensor y;
  if (s.activations == ActivationQuantization::per_token) {
    const auto [scale, zero_point] = asymmetric_int8_qparams(x.detach().amin(-1, true), x.detach().amax(-1, true));
    y = fake_quantize_int8(x, scale, zero_point);
  } else if (!s.input_scale.defined()) {
    const auto [scale, zero_point] = asymmetric_int8_qparams(x.detach().min(), x.detach().max());
    y = fake_quantize_int8(x, scale, zero_point);
  } else {
    if (!s.input_ready) {
      // LSQ's start from the data: the first batch's min/max scale, its offset −zero_point · scale.
      torch::NoGradGuard no_grad;
      if (s.input_scale.item<float>() == 0.0F) {
        const auto [scale, zero_point] = asymmetric_int8_qparams(x.min(), x.max());
        s.input_scale.copy_(scale.reshape({1}));
        s.input_zero.copy_((-zero_point * scale).reshape({1}));
      }
      s.input_ready = true;
    }
    y = learned_fake_quantize(x, s.input_scale, s.input_zero, kActMin, kActMax, x.numel());
  }
  return y.to(input.scalar_type());
}

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  State& s = *state_;
  if (s.quantization == WeightQuantization::none) {
    if (s.float8.scaling() != Float8Scaling::none) return float8_linear(input, weight, bias, s.float8);
    if (s.fake == WeightQuantization::none) return at::linear(input, weight, bias);
    const at::Tensor x = fake_quantized_input(input);
    if (s.learnable) {
      const at::Tensor w =
          learned_weight(weight.to(at::kFloat), s.learned_scale, s.learned_zero, s.fake, s.fake_group_size);
      return at::linear(x, w.to(weight.scalar_type()), bias);
    }
    // Quantization-aware training: the stored weight's values forward, the float weight's gradient
    // backward (w + (q(w) - w).detach() has the value q(w) and the derivative 1).
    const at::Tensor w = weight.detach().to(at::kFloat);
    const QuantizedWeight q = quantize(w, s.fake, s.fake_group_size);
    const at::Tensor offset = (dequantize(q.values, q.scale, q.zero, s.fake_group_size) - w).to(weight.scalar_type());
    return at::linear(x, weight + offset, bias);
  }
  // The weight-only kernels take a 2-D input of the scales' floating type (quantized-dequantized
  // as in training when the layer was trained with int8 activations).
  const auto leading = input.sizes().slice(0, input.dim() - 1);
  const at::Tensor x = fake_quantized_input(input).reshape({-1, options.in_features()});
  at::Tensor y;
  if (s.quantization == WeightQuantization::int8) {
    y = at::_weight_int8pack_mm(x, weight, s.scale.to(x.scalar_type()));
  } else if (x.device().is_cpu()) {
    if (!s.packed.defined() || s.packed_from != weight.const_data_ptr() || s.packed_version != weight._version()) {
      // The CPU kernel's layout (innerKTiles 2) and [groups, out, 2] scales and zeros, made once per
      // loaded weight. The kernel takes output sizes in multiples of 16: pad with zero rows (code 8
      // with scale 1 and zero 0 dequantizes to 0) and drop their outputs. A last group cut short is
      // padded with code 8 to whole groups; the input gets zero columns there, so they add nothing.
      const int64_t out = options.out_features(), padded = (out + 15) / 16 * 16;
      at::Tensor codes = pad_columns(weight.to(at::kInt), s.scale.size(1) * s.group_size, 8);
      at::Tensor scale = s.scale, zero = s.zero;
      if (padded != out) {
        codes = at::cat({codes, at::full({padded - out, codes.size(1)}, 8, codes.options())});
        scale = at::cat({scale, at::ones({padded - out, scale.size(1)}, scale.options())});
        zero = at::cat({zero, at::zeros({padded - out, zero.size(1)}, zero.options())});
      }
      s.packed = at::_convert_weight_to_int4pack_for_cpu(codes, 2);
      s.scales_and_zeros = at::stack({scale, zero}, -1).transpose(0, 1).contiguous();
      s.packed_from = weight.const_data_ptr();
      s.packed_version = weight._version();
    }
    y = at::_weight_int4pack_mm_for_cpu(pad_columns(x, s.scale.size(1) * s.group_size, 0.0), s.packed, s.group_size,
                                        s.scales_and_zeros.to(x.scalar_type()));
    if (y.size(1) != options.out_features()) y = y.narrow(1, 0, options.out_features());
  } else {
    // Other devices: the dequantized matmul (CUDA's tinygemm layout needs sm80 and is packed
    // differently; the result is the same product).
    y = at::matmul(x, dequantized_weight().to(x.scalar_type()).t());
  }
  if (bias.defined()) y = y + bias.to(y.scalar_type());
  std::vector<int64_t> shape(leading.begin(), leading.end());
  shape.push_back(options.out_features());
  return y.reshape(shape);
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::Linear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << (options.bias() ? "true" : "false");
  if (state_->quantization == WeightQuantization::int8) stream << ", weight=int8";
  if (state_->quantization == WeightQuantization::int4) stream << ", weight=int4, group_size=" << state_->group_size;
  if (state_->float8.scaling() != Float8Scaling::none) stream << ", float8=" << to_string(state_->float8.scaling());
  if (state_->activations != ActivationQuantization::none)
    stream << ", activations=int8 " << to_string(state_->activations);
  stream << ")";
}

namespace {

// Every layer under `module` (itself included) by dotted name ("" for the root). named_modules'
// include_self needs a module held by a shared_ptr, so the root is added apart.
std::vector<std::pair<std::string, torch::nn::Module*>> layers_of(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::nn::Module*>> layers = {{"", &module}};
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    layers.emplace_back(item.key(), item.value().get());
  return layers;
}

// The unquantized fulgur::nn::Linear layers whose name matches the ECMAScript regex `filter`
// ("" matches all), with their names.
std::vector<std::pair<std::string, LinearImpl*>> float_linear_layers(torch::nn::Module& module,
                                                                     const std::string& filter) {
  std::optional<std::regex> pattern;
  if (!filter.empty()) {
    try {
      pattern.emplace(filter, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw Error(ErrorKind::config, fmt::format("layer filter '{}' is not a valid regex: {}", filter, e.what()));
    }
  }
  std::vector<std::pair<std::string, LinearImpl*>> found;
  for (const auto& [key, layer] : layers_of(module)) {
    auto* linear = dynamic_cast<LinearImpl*>(layer);
    if (!linear || linear->quantization() != WeightQuantization::none) continue;
    if (pattern && !std::regex_search(key, *pattern)) continue;
    found.emplace_back(key, linear);
  }
  return found;
}

}  // namespace

std::vector<std::string> quantize_linear_weights(torch::nn::Module& module, const QuantizeOptions& options,
                                                 const std::string& filter) {
  std::vector<std::string> done;
  for (const auto& [key, linear] : float_linear_layers(module, filter)) {
    linear->quantize_weight(options);
    done.push_back(key);
  }
  return done;
}

std::vector<std::string> fake_quantize_linear_layers(torch::nn::Module& module, const FakeQuantizeOptions& options,
                                                     const std::string& filter) {
  std::vector<std::string> done;
  for (const auto& [key, linear] : float_linear_layers(module, filter)) {
    linear->fake_quantize(options);
    done.push_back(key);
  }
  return done;
}

std::vector<std::string> quantization_aware_training(torch::nn::Module& module, const QatOptions& options,
                                                     const std::string& filter) {
  std::vector<std::string> done;
  for (const auto& [key, linear] : float_linear_layers(module, filter)) {
    linear->quantization_aware_training(options);
    done.push_back(key);
  }
  return done;
}

std::vector<std::string> prepare_learned_scales(torch::nn::Module& module,
                                                const std::map<std::string, at::Tensor>& state) {
  std::vector<std::string> done;
  for (const auto& [key, linear] : float_linear_layers(module, "")) {
    const std::string prefix = key.empty() ? "" : key + ".";
    const auto scale = state.find(prefix + "weight_scale");
    if (scale == state.end() || !scale->second.defined()) continue;
    const int64_t in = linear->options.in_features();
    FakeQuantizeOptions weight(WeightQuantization::int8);
    if (scale->second.dim() == 2) {
      weight = FakeQuantizeOptions(WeightQuantization::int4);
      int64_t found = 0;
      for (const int64_t g : {32, 64, 128, 256})
        if (group_count(in, g) == scale->second.size(1)) {
          found = g;
          break;
        }
      if (found == 0)
        throw Error(ErrorKind::checkpoint,
                    fmt::format("layer '{}': learned int4 scales for {} groups of {} inputs match no group size "
                                "(32, 64, 128 or 256)",
                                key, scale->second.size(1), in));
      weight.group_size(found);
    }
    const bool input = state.count(prefix + "input_scale") > 0;
    linear->quantization_aware_training(
        QatOptions(weight)
            .activations(input ? ActivationQuantization::per_tensor : linear->qat_options().activations())
            .learnable_scales(true));
    done.push_back(key);
  }
  return done;
}

std::vector<std::string> convert_to_float8_training(torch::nn::Module& module, const Float8Options& options,
                                                    const std::string& filter) {
  std::vector<std::string> done;
  for (const auto& [key, linear] : float_linear_layers(module, filter)) {
    if (!float8_compatible(linear->options.in_features(), linear->options.out_features())) continue;
    linear->float8_training(options);
    done.push_back(key);
  }
  return done;
}

bool prepare_quantized_layers(torch::nn::Module& module, const std::map<std::string, std::string>& metadata) {
  const auto method = metadata.find(kQuantizationMetadataKey);
  if (method == metadata.end()) return false;
  QuantizeOptions options(weight_quantization_from_string(method->second));
  if (options.method() == WeightQuantization::none) return false;
  if (const auto g = metadata.find("fulgur.group_size"); g != metadata.end()) options.group_size(std::stoll(g->second));
  const auto listed = metadata.find("fulgur.quantized_layers");
  if (listed == metadata.end())
    throw Error(ErrorKind::checkpoint, "quantized weights without \"fulgur.quantized_layers\" in their metadata");
  ActivationQuantization activations = ActivationQuantization::none;
  if (const auto a = metadata.find("fulgur.activations"); a != metadata.end())
    activations = activation_quantization_from_string(a->second);
  const auto inputs = metadata.find("fulgur.input_scales");
  const bool learned_inputs = inputs != metadata.end() && inputs->second == "learned";
  if (learned_inputs && activations != ActivationQuantization::per_tensor)
    throw Error(ErrorKind::checkpoint,
                "quantized weights with learned input scales must say \"fulgur.activations\" = "
                "\"per_tensor\"");
  std::map<std::string, torch::nn::Module*> by_name;
  for (const auto& [key, layer] : layers_of(module)) by_name.emplace(key, layer);
  std::stringstream names(listed->second);
  std::string name;
  while (std::getline(names, name, ',')) {
    if (name.empty()) continue;
    const auto found = by_name.find(name);
    if (found == by_name.end())
      throw Error(ErrorKind::checkpoint,
                  fmt::format("the weights quantize layer '{}', which the model does not have", name));
    auto* linear = dynamic_cast<LinearImpl*>(found->second);
    if (!linear)
      throw Error(ErrorKind::checkpoint,
                  fmt::format("the weights hold layer '{}' quantized ({}), but the model declares it as {}: declare it "
                              "as fulgur::nn::Linear (fulgur/nn/linear.h) to serve it quantized",
                              name, method->second, found->second->name()));
    if (linear->quantization() != WeightQuantization::none) continue;
    // Layers served with int8 inputs: "fulgur.activations", and "fulgur.input_scales" = "learned"
    // when the file holds their per-tensor input_scale and input_zero.
    if (activations != ActivationQuantization::none)
      linear->quantization_aware_training(
          QatOptions(FakeQuantizeOptions(options.method()).group_size(options.group_size()))
              .activations(activations)
              .learnable_scales(learned_inputs));
    linear->prepare_quantized(options);
  }
  return true;
}

}  // namespace fulgur::nn
