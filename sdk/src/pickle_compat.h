// Internal: what it takes for LibTorch's pickles and Python's to read each other: plain
// containers for Python going out; coming in, a guard and a rewrite in front of LibTorch's
// unpickler.
#pragma once

#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <string_view>

namespace fulgur::detail {

// Replaces TorchScript-specialised lists (List[int], List[Tensor], ...) with plain lists, at any
// depth, so that the pickle needs no torch.jit globals: even untagged, LibTorch's pickler writes
// them as torch.jit._pickle.build_intlist / build_tensorlist, which Python's
// torch.load(weights_only=True) refuses. Plain dicts and lists are what torch.save writes.
// Containers are rebuilt; tensors are shared.
c10::IValue plain_containers(const c10::IValue& value);

// LibTorch's unpickler grows its memo table to the largest index a BINPUT/LONG_BINPUT names, so
// a small corrupt pickle can make it allocate gigabytes (see pickle::memo_index_possible). This
// walks every opcode up to STOP and returns the problem with the first impossible index or the
// first argument longer than the bytes left (torch allocates what it declares before reading), or
// empty; at a byte that is no opcode of protocols 2 to 4 it stops: torch cannot read on there
// either.
std::string pickle_memo_problem(std::string_view pickle);

// LibTorch's unpickler turns every collections.OrderedDict(...) into None (it expects them only as
// a tensor's empty backward hooks), so torch.save(model.state_dict()) and every Lightning
// checkpoint (whose "state_dict" is an OrderedDict) fail to load. This returns the pickle with
// each `OrderedDict` `()` REDUCE rewritten to EMPTY_DICT (a plain dict, filled by the
// SETITEMS that follow) and the state of each such dict dropped with its BUILD (the state is the
// `_metadata` attribute of a state_dict(), which a plain dict cannot hold and C++ does not use).
// Returns nullopt when there is nothing to rewrite, or at an opcode the walk does not know (torch
// then judges the original).
std::optional<std::string> plain_dicts_for_ordered_dicts(std::string_view pickle);

}  // namespace fulgur::detail
