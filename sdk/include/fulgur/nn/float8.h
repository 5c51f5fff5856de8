/// @file
/// FP8 training of linear layers (SDK 1.4): the recipe of torchao's Float8Linear with dynamic
/// scaling, on ATen's scaled matrix multiplication (at::_scaled_mm).
///
/// Each of a linear layer's three matrix multiplications (the forward `x Wᵀ`, and in the backward
/// `dY W` for the input's gradient and `dYᵀ x` for the weight's) quantizes both operands to FP8
/// just before it runs: an operand's scale is the format's largest value over the operand's
/// largest magnitude (amax), taken over the whole tensor ("tensorwise") or along the dimension the
/// product sums over ("rowwise": one scale per row of the left operand and per column of the right
/// one), and the scaled values are clamped to the format's range before the cast (a plain cast to
/// float8 does not saturate: 500 becomes NaN in e4m3). Activations and weights use e4m3 (more
/// precision), gradients e5m2 (more range). Weights, their gradients and the optimizer state stay
/// in the parameter's precision ("master weights"); FP8 copies live only inside the layer's
/// forward and backward.
///
/// Where it runs (Float8Backend::automatic): on CUDA (sm89 and later) at::_scaled_mm runs both
/// recipes in FP8, except a product whose sizes the kernels cannot take (a dimension not a multiple
/// of 16), which is emulated: the operands are quantized and dequantized exactly as for the kernel,
/// then multiplied in float32 (torchao's `emulate`). On the CPU every product is emulated: ATen's
/// CPU kernel takes only tensorwise scales and is a reference loop (0.8 s for a 64 x 784 x 256
/// product, over 200 times the float32 matmul). The values that reach the product are the same
/// either way; only the accumulation order differs. Float8Backend::scaled_mm runs the kernel
/// everywhere (the CPU's for a bitwise comparison with Python's torch._scaled_mm).
///
/// LibTorch modules cannot be swapped after the fact (a parent calls its typed member), so FP8 is a
/// mode of fulgur::nn::Linear (LinearImpl::float8_training) that convert_to_float8_training turns on
/// for chosen layers; the `fp8` precision plugin does that for a whole model.
#pragma once

#include <fulgur/export.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fulgur::nn {

/// How a tensor's FP8 scale is taken. The values are stable (they are written into configuration
/// and logs by name, see to_string).
enum class Float8Scaling : int32_t {
  none = 0,        ///< FP8 off: the layer computes in its own precision
  tensorwise = 1,  ///< one scale per tensor (torchao's "tensorwise" recipe)
  rowwise = 2,     ///< one scale per row of the left operand and per column of the right one ("rowwise")
};

/// "none", "tensorwise" or "rowwise".
FULGUR_SDK_API std::string to_string(Float8Scaling scaling);

/// The Float8Scaling named `name`; throws fulgur::Error(config) naming the accepted names otherwise.
FULGUR_SDK_API Float8Scaling float8_scaling_from_string(const std::string& name);

/// Which implementation computes an FP8 product. The values are stable.
enum class Float8Backend : int32_t {
  automatic = 0,  ///< at::_scaled_mm on CUDA where it takes the scales and sizes; emulated otherwise
  scaled_mm = 1,  ///< always at::_scaled_mm; a product it refuses throws fulgur::Error(invalid_argument)
  emulated = 2,   ///< always quantize, dequantize, then multiply in float32
};

/// "auto", "scaled_mm" or "emulated".
FULGUR_SDK_API std::string to_string(Float8Backend backend);

/// The Float8Backend named `name`; throws fulgur::Error(config) naming the accepted names otherwise.
FULGUR_SDK_API Float8Backend float8_backend_from_string(const std::string& name);

/// What FP8 training does: `fulgur::nn::Float8Options(Float8Scaling::rowwise).backend(Float8Backend::emulated)`.
struct Float8Options {
  /// FP8 with `scaling` (Float8Scaling::none turns it off).
  /* implicit */ Float8Options(Float8Scaling scaling = Float8Scaling::tensorwise) : scaling_(scaling) {}
  /// How scales are taken.
  TORCH_ARG(Float8Scaling, scaling);
  /// Which implementation computes the products (see the file comment).
  TORCH_ARG(Float8Backend, backend) = Float8Backend::automatic;
};

/// The largest finite value of an FP8 format: 448 for Float8_e4m3fn, 57344 for Float8_e5m2. Throws
/// fulgur::Error(invalid_argument) for another dtype.
FULGUR_SDK_API double float8_max(at::ScalarType float8_dtype);

/// The scale that maps `amax` onto the format's largest value: float8_max / max(amax, 1e-12), in
/// float32 (the clamp keeps an all-zero tensor's scale finite).
FULGUR_SDK_API at::Tensor amax_to_scale(const at::Tensor& amax, at::ScalarType float8_dtype);

/// `x` times `scale`, computed in float32, clamped to ±float8_max and cast to `float8_dtype`: the
/// saturated cast.
FULGUR_SDK_API at::Tensor to_float8_saturated(const at::Tensor& x, const at::Tensor& scale,
                                              at::ScalarType float8_dtype);

/// A tensor quantized to FP8: `data` ≈ original × `scale` (scale [] tensorwise; rowwise a scale per
/// slice, keeping the reduced dimension with size 1 so it broadcasts against `data`).
struct Float8Tensor {
  at::Tensor data;   ///< the FP8 values
  at::Tensor scale;  ///< float32; divide `data` by it to get the original back
  /// data / scale in float32.
  FULGUR_SDK_API at::Tensor dequantize() const;
};

/// Quantizes the 2-D tensor `x` with dynamic scaling: tensorwise the amax of the whole tensor,
/// rowwise the amax along `reduced_dim` (the dimension a matrix product sums over: 1 for a left
/// operand, 0 for a right one). Throws fulgur::Error(invalid_argument) for a tensor that is not 2-D
/// or for Float8Scaling::none.
FULGUR_SDK_API Float8Tensor quantize_float8(const at::Tensor& x, at::ScalarType float8_dtype, Float8Scaling scaling,
                                            int64_t reduced_dim = 1);

/// The product a [M, K] × b [K, N] of two quantized operands, dequantized, as `out_dtype`: through
/// at::_scaled_mm (with the scales' reciprocals, as it takes them) or emulated, as `backend` says
/// (see the file comment).
FULGUR_SDK_API at::Tensor float8_mm(const Float8Tensor& a, const Float8Tensor& b, at::ScalarType out_dtype,
                                    Float8Backend backend = Float8Backend::automatic);

/// y = x Wᵀ + b with the three products in FP8 as the file comment says: `input` [..., in],
/// `weight` [out, in], `bias` [out] or undefined. Differentiable in input, weight and bias (the bias
/// and its gradient stay in high precision). The output has the input's dtype, or the autocast
/// dtype where autocast is on for the input's device.
FULGUR_SDK_API at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                        const Float8Options& options);

/// Whether a layer from `in_features` to `out_features` can train in FP8: both multiples of 16, as
/// the CUDA kernels need (torchao skips other layers too).
FULGUR_SDK_API bool float8_compatible(int64_t in_features, int64_t out_features);

/// Turns FP8 training on (or off, with Float8Scaling::none) for every unquantized fulgur::nn::Linear
/// under `module` (itself included) whose dotted name matches the ECMAScript regex `filter` (empty:
/// all; e.g. "^(?!lm_head)" to keep the output layer in high precision) and whose sizes are
/// float8_compatible. Returns the names of the layers it turned on. Idempotent.
FULGUR_SDK_API std::vector<std::string> convert_to_float8_training(torch::nn::Module& module,
                                                                   const Float8Options& options,
                                                                   const std::string& filter = "");

}  // namespace fulgur::nn
