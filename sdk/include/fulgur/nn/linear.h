/// @file
/// fulgur::nn::Linear: torch::nn::Linear's layer whose weight can be stored quantized for inference
/// (int8 per output channel, or int4 in groups along the input dimension: "weight-only"
/// quantization, activations stay in floating point). SDK 1.3.
///
/// LibTorch's C++ modules cannot be swapped for quantized ones after the fact: a parent calls its
/// typed member (`torch::nn::Linear fc`) directly. A model that wants to serve quantized declares
/// this layer where it would declare torch::nn::Linear. Unquantized it computes exactly what
/// torch::nn::Linear computes (the same at::linear call), with the same parameter names (`weight`,
/// `bias`) and initialization, so checkpoints and state dicts are interchangeable with
/// torch.nn.Linear.
///
/// Quantized (quantize_weight, or load_quantized_weights for a file `fulgur quantize` wrote), the
/// float `weight` parameter is replaced by buffers, stored unpacked so that any program can read
/// them:
///
///   int8:  weight [out, in] int8, weight_scale [out] float32;            w = weight * scale
///   int4:  weight [out, in] uint8 in 0..15, weight_scale and weight_zero
///          [out, in / group_size] float32;                                w = (weight - 8) * scale + zero
///
/// (the int4 convention is tinygemm's, as torchao's Int4WeightOnlyConfig uses it). The forward then
/// runs ATen's weight-only kernels (at::_weight_int8pack_mm; at::_weight_int4pack_mm_for_cpu on a
/// weight packed once, at the first forward, for the CPU's kernel), and its output equals the input
/// multiplied by the dequantized weight. Quantized layers are for inference: they have no weight
/// gradient.
#pragma once

#include <fulgur/export.h>
#include <fulgur/nn/float8.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>

namespace fulgur::nn {

/// Options of fulgur::nn::Linear: torch::nn::LinearOptions' fields and defaults,
/// `fulgur::nn::LinearOptions(784, 256).bias(false)`.
struct LinearOptions {
  /// A layer from `in_features` inputs to `out_features` outputs.
  LinearOptions(int64_t in_features, int64_t out_features) : in_features_(in_features), out_features_(out_features) {}
  /// Size of each input sample (the input's last dimension).
  TORCH_ARG(int64_t, in_features);
  /// Size of each output sample.
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias.
  TORCH_ARG(bool, bias) = true;
};

/// How a weight is stored. The values are stable (they are written into files' metadata by name,
/// see to_string).
enum class WeightQuantization : int32_t {
  none = 0,  ///< float weight (the parameter `weight`)
  int8 = 1,  ///< symmetric int8, one scale per output channel
  int4 = 2,  ///< asymmetric 4-bit, a scale and a zero per group of `group_size` inputs
};

/// "none", "int8" or "int4" (what safetensors metadata and `fulgur quantize --method` say).
FULGUR_SDK_API std::string to_string(WeightQuantization quantization);

/// The WeightQuantization named `name` ("int8", "int4", "none"); throws fulgur::Error(config)
/// naming the accepted names otherwise.
FULGUR_SDK_API WeightQuantization weight_quantization_from_string(const std::string& name);

/// What quantize_weight does: `fulgur::nn::QuantizeOptions(WeightQuantization::int4).group_size(32)`.
struct QuantizeOptions {
  /// Quantize to `method`.
  /* implicit */ QuantizeOptions(WeightQuantization method) : method_(method) {}
  /// The storage to quantize to.
  TORCH_ARG(WeightQuantization, method);
  /// int4: inputs per group (32, 64, 128 or 256; it must divide in_features).
  TORCH_ARG(int64_t, group_size) = 128;
};

/// Quantization-aware training: the forward computes with the weight as `quantize_weight(options)`
/// would store it (quantized then dequantized with scales from the current weight), while the
/// gradient flows to the float weight unchanged (straight-through estimator). Since the scales come
/// from each row's (int8) or group's (int4) minimum and maximum, no weight is clipped, so the
/// straight-through gradient is exact. `fulgur::nn::FakeQuantizeOptions(WeightQuantization::int4).group_size(32)`.
struct FakeQuantizeOptions {
  /// Train for `method` storage.
  /* implicit */ FakeQuantizeOptions(WeightQuantization method) : method_(method) {}
  /// The storage the training prepares for (int8 or int4).
  TORCH_ARG(WeightQuantization, method);
  /// int4: inputs per group (32, 64, 128 or 256).
  TORCH_ARG(int64_t, group_size) = 128;
};

/// How quantization-aware training quantizes a layer's input (its activations). SDK 1.5.
enum class ActivationQuantization : int32_t {
  none = 0,        ///< the input stays in floating point (weight-only training)
  per_token = 1,   ///< int8, one scale and zero point per row (token), from the row's min and max
  per_tensor = 2,  ///< int8, one scale and zero point for the whole input
};

/// "none", "per_token" or "per_tensor" (what the `qat` callback's `activations` option says). SDK 1.5.
FULGUR_SDK_API std::string to_string(ActivationQuantization quantization);

/// The ActivationQuantization named `name`; throws fulgur::Error(config) naming the accepted names
/// otherwise. SDK 1.5.
FULGUR_SDK_API ActivationQuantization activation_quantization_from_string(const std::string& name);

/// Quantization-aware training with everything it can train for (SDK 1.5):
/// `fulgur::nn::QatOptions(fulgur::nn::FakeQuantizeOptions(WeightQuantization::int4).group_size(32))
///      .activations(ActivationQuantization::per_token).learnable_scales(true)`.
///
/// Activations are fake-quantized to asymmetric int8 (-128..127) with torchao's (and XNNPACK's)
/// choose_qparams_per_token_asymmetric: the range [min(x, 0), max(x, 0)] over the row (per_token)
/// or the whole input (per_tensor), scale = range / 255, an integer zero point; asymmetric
/// because the inputs of layers after a ReLU are one-sided, and symmetric codes would waste half of
/// them. The gradient goes straight through where the value lies in the representable range and is
/// zero where it was clipped.
///
/// learnable_scales: LSQ (Esser et al. 2019, "Learned Step Size Quantization"). The weight scales
/// (int8: `weight_scale` [out]; int4: `weight_scale` and `weight_zero` [out, groups], the offset
/// learned as in LSQ+) and, with per_tensor activations, `input_scale` and `input_zero` [1] become
/// parameters, trained with the LSQ gradient: d ŵ / d s = round(v) − v inside the range, the
/// bound outside (v = (w − zero) / s), multiplied by g = 1 / sqrt(numel · qmax), numel being the
/// number of values one scale quantizes (in_features, group_size, or the input's elements), and the
/// weight's gradient is clipped straight-through. They start from the min/max scales of the data
/// (the weight at the call; the first training batch for the input), so training starts where
/// fixed-scale QAT does. quantize_weight then stores the weight with the learned scales. Per-token
/// activation scales are computed per row and not learned.
///
/// A layer quantized after such training keeps quantizing its input as it trained (learned
/// per-tensor scales become the buffers `input_scale`, `input_zero`), before the weight-only
/// kernel; prepare_quantized_layers rebuilds that from a file's "fulgur.activations" and
/// "fulgur.input_scales" = "learned" metadata (what `fulgur quantize` writes).
struct QatOptions {
  /// Train for `weight` storage.
  /* implicit */ QatOptions(FakeQuantizeOptions weight) : weight_(weight) {}
  /// The weight storage to train for (its method none turns quantization-aware training off).
  TORCH_ARG(FakeQuantizeOptions, weight);
  /// How the input is fake-quantized.
  TORCH_ARG(ActivationQuantization, activations) = ActivationQuantization::none;
  /// LSQ: learn the weight scales (and the per_tensor input scale) as parameters.
  TORCH_ARG(bool, learnable_scales) = false;
};

/// A fully connected layer, y = x Wᵀ + b, like torch::nn::Linear, that can hold its weight
/// quantized (see the file comment).
class FULGUR_SDK_API LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  /// A layer with `options`' sizes, initialized as torch::nn::Linear initializes.
  explicit LinearImpl(const LinearOptions& options);
  /// A layer from `in_features` to `out_features` with a bias.
  LinearImpl(int64_t in_features, int64_t out_features) : LinearImpl(LinearOptions(in_features, out_features)) {}
  /// A copy with its own quantization state (what torch::nn::Cloneable::clone starts from; clone()
  /// of a quantized layer is refused by libtorch, its parameters differ from a fresh layer's).
  LinearImpl(const LinearImpl& other);
  /// Assigns `other`'s options, tensors and quantization state (torch::nn::Cloneable's clone_ uses it).
  LinearImpl& operator=(const LinearImpl& other);
  ~LinearImpl() override;
  /// Creates the float parameters and initializes them (kaiming-uniform weight, uniform bias): what
  /// the constructor and torch::nn::Cloneable::clone call, on a layer without parameters.
  void reset() override;
  /// Re-initializes the float parameters as torch::nn::Linear::reset_parameters does.
  void reset_parameters();
  /// `input` [..., in_features] → [..., out_features], in the input's floating type.
  at::Tensor forward(const at::Tensor& input);
  /// `fulgur::nn::Linear(in_features=…, out_features=…, bias=…[, weight=int8])`.
  void pretty_print(std::ostream& stream) const override;

  /// Quantizes the float weight in place (the parameter `weight` becomes the buffers the file
  /// comment lists). int8: scale = max |w| / 127 per output channel, weight = round(w / scale).
  /// int4: per group, scale = (max - min) / 15, zero = min + 8 scale, weight = round((w - min) /
  /// scale) clamped to 0..15. Throws fulgur::Error(invalid_argument) if the layer is quantized
  /// already or group_size does not divide in_features.
  void quantize_weight(const QuantizeOptions& options);
  /// Gives the layer the quantized buffers of `method`, with the right shapes and zero values, for
  /// a strict load of a quantized state dict (load_quantized_weights does this for every layer).
  void prepare_quantized(const QuantizeOptions& options);
  /// Quantization-aware training on (see FakeQuantizeOptions) or, with WeightQuantization::none, off.
  /// Throws fulgur::Error(invalid_argument) on a quantized layer or for a group size the int4
  /// storage cannot take.
  void fake_quantize(const FakeQuantizeOptions& options);
  /// What fake_quantize set: WeightQuantization::none when off.
  WeightQuantization fake_quantization() const;
  /// How the weight is stored now.
  WeightQuantization quantization() const;
  /// int4: the group size; 0 otherwise.
  int64_t group_size() const;
  /// The weight as float32 [out_features, in_features]: the parameter, or the dequantized buffers.
  at::Tensor dequantized_weight() const;
  /// FP8 training on (see fulgur/nn/float8.h: the forward and backward products run in FP8, the
  /// weight stays in its precision) or, with Float8Scaling::none, off. Throws
  /// fulgur::Error(invalid_argument) on a quantized layer, on one training with fake_quantize, and
  /// for sizes that are not float8_compatible. SDK 1.4.
  void float8_training(const Float8Options& options);
  /// What float8_training set: scaling Float8Scaling::none when off. SDK 1.4.
  Float8Options float8_options() const;
  /// Quantization-aware training of the weight, the input, and the scales as `options` say (see
  /// QatOptions); fake_quantize(options.weight()) is the call with activations none and fixed
  /// scales, and options.weight() with WeightQuantization::none turns all of it off (the learned
  /// scales are dropped). Calling it again with the same options keeps the learned scales. Throws
  /// fulgur::Error(invalid_argument) as fake_quantize does, and for activations or learnable scales
  /// without a weight method. SDK 1.5.
  void quantization_aware_training(const QatOptions& options);
  /// What quantization_aware_training (or fake_quantize) set. SDK 1.5.
  QatOptions qat_options() const;

  /// The options the layer was made with.
  LinearOptions options;
  /// Unquantized: the float weight [out_features, in_features] (a parameter). Quantized: the
  /// integer weight (a buffer; see the file comment).
  at::Tensor weight;
  /// The bias [out_features] (a parameter; undefined without bias).
  at::Tensor bias;

 private:
  // SDK 1.5: the input as quantization-aware training sees it, and the removal of the LSQ
  // parameters (on convert, or when the training changes storage).
  at::Tensor fake_quantized_input(const at::Tensor& input);
  void drop_learned_scales();

  struct State;
  std::unique_ptr<State> state_;  // quantization scales, packed kernel weights; grows without changing this layout
};

/// The module holder: `fulgur::nn::Linear fc = register_module("fc", fulgur::nn::Linear(784, 256));`.
TORCH_MODULE(Linear);

/// Turns quantization-aware training on (or off, with WeightQuantization::none) for every
/// unquantized fulgur::nn::Linear under `module` whose dotted name matches `filter` (as
/// quantize_linear_weights). Returns the names of the layers it set.
FULGUR_SDK_API std::vector<std::string> fake_quantize_linear_layers(torch::nn::Module& module,
                                                                    const FakeQuantizeOptions& options,
                                                                    const std::string& filter = "");

/// quantization_aware_training(options) for every unquantized fulgur::nn::Linear under `module`
/// whose dotted name matches `filter` (as quantize_linear_weights). Returns the names of the layers
/// it set. SDK 1.5.
FULGUR_SDK_API std::vector<std::string> quantization_aware_training(torch::nn::Module& module,
                                                                    const QatOptions& options,
                                                                    const std::string& filter = "");

/// Before loading `state` (a state dict by dotted name) into `module`: every float
/// fulgur::nn::Linear whose learned scales (LSQ, see QatOptions) `state` holds gets them as
/// parameters of the right shapes (int8 for a [out] `weight_scale`, int4 with the smallest group
/// size that gives the groups of a [out, groups] one), with fake quantization on. Returns the names
/// of those layers. What `fulgur validate | test | predict | quantize --ckpt_path` call so that a
/// checkpoint trained with learnable scales loads strictly. SDK 1.5.
FULGUR_SDK_API std::vector<std::string> prepare_learned_scales(torch::nn::Module& module,
                                                               const std::map<std::string, at::Tensor>& state);

/// Quantizes the weight of every fulgur::nn::Linear under `module` (itself included) whose dotted
/// name matches the ECMAScript regex `filter` (empty: all), e.g. "^(?!lm_head)" to skip the output
/// layer. Returns the names of the layers it quantized. Layers declared as torch::nn::Linear are
/// left alone (they cannot run quantized); convolutions and embeddings are not touched.
FULGUR_SDK_API std::vector<std::string> quantize_linear_weights(torch::nn::Module& module,
                                                                const QuantizeOptions& options,
                                                                const std::string& filter = "");

/// The safetensors metadata key under which quantized weight files say how they were quantized:
/// "fulgur.quantization" = "int8" | "int4", with "fulgur.group_size" for int4, and
/// "fulgur.quantized_layers" = the comma-separated dotted names of the quantized layers.
inline constexpr const char* kQuantizationMetadataKey = "fulgur.quantization";

/// Before a strict load of a file written from a quantized model: prepares every layer that
/// `metadata` (the file's safetensors metadata) lists as quantized. Returns false, doing nothing,
/// when the metadata says nothing of quantization. Throws fulgur::Error(checkpoint) naming the
/// layer when a listed layer is missing from `module` or is not a fulgur::nn::Linear (declare it
/// as fulgur::nn::Linear to serve it quantized).
FULGUR_SDK_API bool prepare_quantized_layers(torch::nn::Module& module,
                                             const std::map<std::string, std::string>& metadata);

}  // namespace fulgur::nn
