#include <fulgur/detail/ivalue_dict.h>
#include <fulgur/error.h>

#include <fmt/format.h>

namespace fulgur::detail {

c10::impl::GenericDict string_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }
c10::impl::GenericDict int_dict() { return c10::impl::GenericDict(c10::IntType::get(), c10::AnyType::get()); }
c10::impl::GenericList any_list() { return c10::impl::GenericList(c10::AnyType::get()); }

c10::impl::GenericDict as_dict(const c10::IValue& v, const std::string& what, const std::string& path) {
  if (!v.isGenericDict())
    throw Error(
        ErrorKind::checkpoint,
        fmt::format("checkpoint {}: '{}' is not a dict; the file is not a Fulgur/Lightning checkpoint", path, what));
  return v.toGenericDict();
}

std::optional<c10::IValue> get(const c10::impl::GenericDict& d, const std::string& key) {
  auto it = d.find(key);
  if (it == d.end()) return std::nullopt;
  return it->value();
}

c10::IValue require_key(const c10::impl::GenericDict& d, const std::string& key, const std::string& path,
                        const std::string& hint) {
  auto v = get(d, key);
  if (!v) throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: key '{}' is missing; {}", path, key, hint));
  return *v;
}

}  // namespace fulgur::detail
