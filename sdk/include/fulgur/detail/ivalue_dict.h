/// @file
/// Internal (fulgur::detail, not part of the SDK 1.x promise): the IValue dict helpers that the
/// SDK's state-dict code and the engine's checkpoint assembly and loop state share, so that both
/// read checkpoints with the same checks and the same messages.
#pragma once

#include <fulgur/export.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>

namespace fulgur::detail {

/// A dict with string keys and values of any type (what torch.save writes for a Python dict).
FULGUR_SDK_API c10::impl::GenericDict string_dict();
/// A dict with integer keys and values of any type (an optimizer's "state" by parameter index).
FULGUR_SDK_API c10::impl::GenericDict int_dict();
/// A list of values of any type.
FULGUR_SDK_API c10::impl::GenericList any_list();
/// `v` as a dict; throws fulgur::Error(checkpoint) naming `what` and the checkpoint `path` otherwise.
FULGUR_SDK_API c10::impl::GenericDict as_dict(const c10::IValue& v, const std::string& what, const std::string& path);
/// The value under `key`, or nullopt.
FULGUR_SDK_API std::optional<c10::IValue> get(const c10::impl::GenericDict& d, const std::string& key);
/// The value under `key`; throws fulgur::Error(checkpoint) naming the checkpoint `path`, the key and `hint`.
FULGUR_SDK_API c10::IValue require_key(const c10::impl::GenericDict& d, const std::string& key, const std::string& path,
                                       const std::string& hint);

}  // namespace fulgur::detail
