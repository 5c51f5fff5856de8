// Internal: makes Python pickles that LibTorch's unpickler misreads readable by it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace fulgur::detail {

// LibTorch's unpickler turns every collections.OrderedDict(...) into None (it expects them only as
// a tensor's empty backward hooks), so torch.save(model.state_dict()) and every Lightning
// checkpoint (whose "state_dict" is an OrderedDict) fail to load. This returns the pickle with
// each `OrderedDict` `()` REDUCE rewritten to EMPTY_DICT (a plain dict, filled by the
// SETITEMS that follow) and the state of each such dict dropped with its BUILD (the state is the
// `_metadata` attribute of a state_dict(), which a plain dict cannot hold and C++ does not use).
// Returns nullopt when there is
// nothing to rewrite, or at an opcode the walk does not know (torch then judges the original).
std::optional<std::string> plain_dicts_for_ordered_dicts(const uint8_t* p, size_t n);

}  // namespace fulgur::detail
