// What the sharded strategies (fsdp, model_parallel) share to reshape an optimizer's state: a walk
// over torch.optim's state_dict layout ({"state": {index: {name: tensor}}, "param_groups": ...})
// that rewrites each parameter's per-element tensors and leaves everything else as it is.
// Header-only: each strategy is its own plugin library and may use only the SDK.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fulgur::optimizer_state {

// `state` with every tensor of a parameter's state except "step" (parameter `index` < `count`)
// replaced by fn(index, name, tensor); nullopt leaves it out. Entries that are not tensors, and
// indices outside the parameters, are kept. A new dict; the input is left alone. Keys are visited
// in the dict's order, the same on every rank, so collectives inside `fn` pair up.
template <class Fn>
c10::IValue map_parameter_states(const c10::IValue& state, int64_t count, Fn&& fn) {
  if (!state.isGenericDict()) return state;
  const auto whole = state.toGenericDict();
  auto out = c10::impl::GenericDict(whole.keyType(), whole.valueType());
  for (const auto& entry : whole) {
    if (!(entry.key().isString() && entry.key().toStringRef() == "state") || !entry.value().isGenericDict()) {
      out.insert(entry.key(), entry.value());
      continue;
    }
    const auto per_parameter = entry.value().toGenericDict();
    auto mapped = c10::impl::GenericDict(per_parameter.keyType(), per_parameter.valueType());
    for (const auto& item : per_parameter) {
      const int64_t index = item.key().isInt() ? item.key().toInt() : -1;
      if (index < 0 || index >= count || !item.value().isGenericDict()) {
        mapped.insert(item.key(), item.value());
        continue;
      }
      const auto tensors = item.value().toGenericDict();
      auto converted = c10::impl::GenericDict(tensors.keyType(), tensors.valueType());
      for (const auto& t : tensors) {
        const std::string name = t.key().isString() ? t.key().toStringRef() : std::string();
        if (!t.value().isTensor() || name == "step") {
          converted.insert(t.key(), t.value());
          continue;
        }
        if (std::optional<at::Tensor> result = fn(index, name, t.value().toTensor()))
          converted.insert(t.key(), *result);
      }
      mapped.insert(item.key(), converted);
    }
    out.insert(entry.key(), mapped);
  }
  return out;
}

}  // namespace fulgur::optimizer_state
