// The emulated device's kernels, registered for the PrivateUse1 dispatch key.
//
// A backend implements a small core natively (tensor creation over its allocator, views that
// share storage, copies in and out, reading a scalar) and may send every other operator to a
// boxed fallback. Here the fallback runs the CPU kernel on CPU copies of the arguments
// (at::native::cpu_fallback) after handing the device's RNG to the random operators, so that
// random numbers drawn "on the device" come from the device's generator, not the CPU's.
//
// VENDOR: implement the operators your hardware runs natively (m.impl per operator, as below);
// keep the fallback for the rest while you bring the backend up, then shrink it.
#include "emu_runtime.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Functions.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace emu {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

// ---------------------------------------------------------------------------------------------
// Creation: storage from the device allocator (c10::GetAllocator(PrivateUse1)) on the device the
// options name; the guard makes it current so the allocator tags the memory with it.
void check_options(c10::Device device, std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(device.is_privateuseone(), "emulated device: cannot create a tensor on ", device.str());
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "emulated device: only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "emulated device: pinned memory is a host-side property");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  const c10::Device where = c10::device_or_default(device);
  check_options(where, layout, pin_memory);
  const c10::DeviceGuard guard(where);
  return at::detail::empty_generic(size, c10::GetAllocator(c10::DeviceType::PrivateUse1), kKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  const c10::Device where = c10::device_or_default(device);
  check_options(where, layout, pin_memory);
  const c10::DeviceGuard guard(where);
  return at::detail::empty_strided_generic(size, stride, c10::GetAllocator(c10::DeviceType::PrivateUse1), kKeys,
                                           c10::dtype_or_default(dtype));
}

// ---------------------------------------------------------------------------------------------
// Views and storage: ATen's device-independent implementations (they only rewrite sizes, strides
// and offsets, or reallocate through the storage's own allocator).
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}
at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }
at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}
const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat> format) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, format);
}
at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }
at::Tensor& set_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, std::move(source)); }
at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

// Whether `self`'s TensorImpl may take `from`'s metadata (Variable::set_data, which
// torch::nn::Module::to uses to move parameters): c10 counts only its own dense backends as
// compatible with each other, so a CPU parameter could not become a device one.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::Layout::Strided && (t.device().is_cpu() || t.device().is_privateuseone());
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) || (dense(self) && dense(from));
}

// ---------------------------------------------------------------------------------------------
// Copies. VENDOR: host-to-device, device-to-host and device-to-device DMA. Device memory is host
// memory here, so each side is viewed as a CPU tensor over the same bytes (strides and dtype
// conversion are then the CPU copy's business).
at::Tensor host_view(const at::Tensor& t) {
  if (!t.device().is_privateuseone()) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "emulated device: copy of an undefined tensor");
  TORCH_CHECK((self.device().is_cpu() || self.device().is_privateuseone()) &&
                  (dst.device().is_cpu() || dst.device().is_privateuseone()),
              "emulated device: cannot copy from ", self.device().str(), " to ", dst.device().str());
  at::Tensor target = host_view(dst);
  at::native::copy_(target, host_view(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return at::native::_local_scalar_dense_cpu(self); }

// ---------------------------------------------------------------------------------------------
// Dropout. The CPU kernel of native_dropout takes no generator (it draws from the CPU default
// one), so the fallback could not give it the device's RNG: this is the same computation with
// its draw (bernoulli_) on the device, which the fallback serves from the device generator.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) return {input, at::empty_like(input)};
  if (train.has_value() && !*train) return {input.clone(), at::ones_like(input, input.options().dtype(c10::kBool))};
  const double keep = 1.0 - p;
  const double scale = keep == 0 ? 0.0 : 1.0 / keep;
  at::Tensor mask = at::empty_like(input, c10::MemoryFormat::Contiguous).bernoulli_(keep);
  at::Tensor output = input.mul(mask).mul_(scale);
  return {output, mask.to(c10::kBool)};
}

// ---------------------------------------------------------------------------------------------
// Convolution. For a backend it does not know, ATen routes convolutions to the *_overrideable
// operators, which have no CPU kernel a fallback could run: run the CPU convolution on copies.
at::Tensor on_cpu(const at::Tensor& t) { return t.defined() ? t.to(c10::kCPU) : t; }

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                       c10::IntArrayRef output_padding, int64_t groups) {
  const std::optional<at::Tensor> cpu_bias = bias && bias->defined() ? std::optional(on_cpu(*bias)) : std::nullopt;
  return at::convolution(on_cpu(input), on_cpu(weight), cpu_bias, stride, padding, dilation, transposed, output_padding,
                         groups)
      .to(input.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(const at::Tensor& grad_output,
                                                                    const at::Tensor& input, const at::Tensor& weight,
                                                                    c10::IntArrayRef stride, c10::IntArrayRef padding,
                                                                    c10::IntArrayRef dilation, bool transposed,
                                                                    c10::IntArrayRef output_padding, int64_t groups,
                                                                    std::array<bool, 3> output_mask) {
  const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  auto [gi, gw, gb] =
      at::convolution_backward(on_cpu(grad_output), on_cpu(input), on_cpu(weight), c10::IntArrayRef{channels}, stride,
                               padding, dilation, transposed, output_padding, groups, output_mask);
  auto back = [&](const at::Tensor& t) { return t.defined() ? t.to(input.device()) : t; };
  return {back(gi), back(gw), back(gb)};
}

// ---------------------------------------------------------------------------------------------
// The fallback: any other operator runs on the CPU. Its Generator? arguments are first mapped to
// the device's RNG: none -> the default generator of the device the operator runs on; an
// emulated-device generator -> the CPU engine behind it.
bool is_generator(const c10::Argument& argument) {
  c10::TypePtr type = argument.type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  return type->kind() == c10::TypeKind::GeneratorType;
}

c10::DeviceIndex device_of(const torch::jit::Stack& stack, size_t first, size_t count) {
  for (size_t i = first; i < first + count; ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_privateuseone())
      return v.toTensor().device().index();
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList().vec())
        if (t.defined() && t.device().is_privateuseone()) return t.device().index();
  }
  return current_device();
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (!is_generator(arguments[i])) continue;
    c10::IValue& value = (*stack)[first + i];
    at::Generator generator =
        value.isNone() ? default_generator(device_of(*stack, first, arguments.size())) : value.toGenerator();
    if (generator.device().is_privateuseone()) value = c10::IValue(engine_of(generator));
  }
  at::native::cpu_fallback(op, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("native_dropout", native_dropout);
  m.impl("convolution_overrideable", convolution);
  m.impl("convolution_backward_overrideable", convolution_backward);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>()); }

}  // namespace emu
