// Internal: the IValue dict helpers the loops' state dicts and checkpoint assembly use. They live in
// the SDK (fulgur/detail/ivalue_dict.h), which reads checkpoints with the same checks.
#pragma once

#include <fulgur/detail/ivalue_dict.h>

namespace fulgur {

using detail::any_list;
using detail::as_dict;
using detail::get;
using detail::require_key;
using detail::string_dict;

}  // namespace fulgur
