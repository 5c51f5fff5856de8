/// @file
/// Model and optimizer state in the layouts PyTorch and Lightning use, for strategies (these are
/// the Strategy base class defaults) and for anyone moving weights in and out of a Module. Plain
/// functions of their arguments: no collective, no state of their own.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <string>
#include <vector>

namespace fulgur {

struct CheckpointParts;

/// The module's state: a dict (GenericDict str -> Tensor) of dotted Python names
/// ("features.0.weight") to tensors, parameters and buffers alike, detached but not copied (they
/// share storage with the module).
FULGUR_SDK_API c10::IValue module_state_dict(torch::nn::Module& module);
/// Copies `state` into the module's parameters and buffers (no reallocation). With `strict`,
/// missing or unexpected keys throw; shape mismatches always throw. fulgur::Error(checkpoint)
/// lists every offending key and names `origin` (a path, usually); nothing is copied then.
FULGUR_SDK_API void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                                           const std::string& origin);

/// One optimizer's state in torch.optim's state_dict layout (`{"state": {index: {...}},
/// "param_groups": [{"lr", ..., "params": [indices]}]}`) for Adam, AdamW and SGD, which Python
/// reads as its own; other LibTorch optimizers add their own archive as bytes so resume stays
/// exact. Tensors are shared with the optimizer, not copied.
FULGUR_SDK_API c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer);
/// Restores what optimizer_state_dict produced (or torch.optim's state_dict from Python): the
/// per-parameter state and each group's options (lr included). Throws fulgur::Error(checkpoint)
/// naming `origin` when the groups or their parameter counts do not match the optimizer.
FULGUR_SDK_API void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                              const std::string& origin);

/// One Lightning-layout dict from parts: the metadata keys, "state_dict" (the model state) and
/// "optimizer_states" (left out when there are none). Null parts are left out.
FULGUR_SDK_API c10::IValue join_checkpoint(const CheckpointParts& parts);
/// The reverse of join_checkpoint: fills the non-null parts of `out` from `whole`. Throws
/// fulgur::Error(checkpoint) naming `origin` when the value is not a checkpoint dict or holds no
/// "state_dict".
FULGUR_SDK_API void split_checkpoint(const c10::IValue& whole, const CheckpointParts& out, const std::string& origin);

}  // namespace fulgur
