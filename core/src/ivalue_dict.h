// Internal: the few IValue dict helpers that checkpoint assembly and the loops' state dicts share.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>

namespace fulgur {

// A dict with string keys and values of any type (what torch.save writes for a Python dict).
c10::impl::GenericDict string_dict();
c10::impl::GenericList any_list();
// `v` as a dict; throws fulgur::Error(checkpoint) naming `what` and the file otherwise.
c10::impl::GenericDict as_dict(const c10::IValue& v, const std::string& what, const std::string& path);
std::optional<c10::IValue> get(const c10::impl::GenericDict& d, const std::string& key);
// The value under `key`; throws fulgur::Error(checkpoint) naming the file, the key and `hint`.
c10::IValue require_key(const c10::impl::GenericDict& d, const std::string& key, const std::string& path,
                        const std::string& hint);

}  // namespace fulgur
