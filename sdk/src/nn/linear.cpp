// fulgur::nn::Linear: torch::nn::Linear's computation, plus weight-only int8/int4 storage served
// by ATen's weight-only kernels.
#include <fulgur/error.h>
#include <fulgur/nn/linear.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <ostream>
#include <regex>
#include <sstream>

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
      state_(std::make_unique<State>(*other.state_)) {}

LinearImpl& LinearImpl::operator=(const LinearImpl& other) {
  if (this == &other) return *this;
  torch::nn::Cloneable<LinearImpl>::operator=(other);
  options = other.options;
  weight = other.weight;
  bias = other.bias;
  *state_ = *other.state_;
  return *this;
}

LinearImpl::~LinearImpl() = default;

void LinearImpl::reset() {
  if (options.in_features() < 1 || options.out_features() < 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("fulgur::nn::Linear: in_features and out_features must be at least 1, got {} and {}",
                            options.in_features(), options.out_features()));
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

}  // namespace

void LinearImpl::quantize_weight(const QuantizeOptions& q) {
  if (state_->quantization != WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument, fmt::format("fulgur::nn::Linear: the weight is already quantized ({})",
                                                         to_string(state_->quantization)));
  if (q.method() == WeightQuantization::none)
    throw Error(ErrorKind::invalid_argument, "fulgur::nn::Linear::quantize_weight: choose int8 or int4");
  if (q.method() == WeightQuantization::int4) check_group_size(q.group_size());
  const QuantizedWeight quantized = quantize(weight.detach().to(at::kFloat), q.method(), q.group_size());
  prepare_quantized(q);
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
  state_->fake = options.method();
  state_->fake_group_size = options.method() == WeightQuantization::int4 ? options.group_size() : 0;
}

WeightQuantization LinearImpl::fake_quantization() const { return state_->fake; }

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

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  State& s = *state_;
  if (s.quantization == WeightQuantization::none) {
    if (s.float8.scaling() != Float8Scaling::none) return float8_linear(input, weight, bias, s.float8);
    if (s.fake == WeightQuantization::none) return at::linear(input, weight, bias);
    // Quantization-aware training: the stored weight's values forward, the float weight's gradient
    // backward (w + (q(w) - w).detach() has the value q(w) and the derivative 1).
    const at::Tensor w = weight.detach().to(at::kFloat);
    const QuantizedWeight q = quantize(w, s.fake, s.fake_group_size);
    const at::Tensor offset = (dequantize(q.values, q.scale, q.zero, s.fake_group_size) - w).to(weight.scalar_type());
    return at::linear(input, weight + offset, bias);
  }
  // The weight-only kernels take a 2-D input of the scales' floating type.
  const auto leading = input.sizes().slice(0, input.dim() - 1);
  const at::Tensor x = input.reshape({-1, options.in_features()});
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
    if (linear->quantization() == WeightQuantization::none) linear->prepare_quantized(options);
  }
  return true;
}

}  // namespace fulgur::nn
