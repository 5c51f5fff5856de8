// Model and optimizer state in the layouts PyTorch and Lightning use, for strategies (these are
// the Strategy base class defaults) and for anyone moving weights in and out of a Module.
//
// Model state: a dict of dotted Python names ("features.0.weight") to tensors, parameters and
// buffers alike. Optimizer state: torch.optim's state_dict layout ({"state": {index: {...}},
// "param_groups": [{"lr", ..., "params": [indices]}]}) for Adam, AdamW and SGD, which Python
// reads as its own; other LibTorch optimizers add their own archive as bytes so resume stays
// exact.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <string>
#include <vector>

namespace fulgur {

struct CheckpointParts;

FULGUR_SDK_API c10::IValue module_state_dict(torch::nn::Module& module);
// Copies `state` into the module's parameters and buffers (no reallocation). With `strict`,
// missing or unexpected keys throw; shape mismatches always throw. fulgur::Error(checkpoint)
// lists every offending key and names `origin` (a path, usually).
FULGUR_SDK_API void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                                           const std::string& origin);

FULGUR_SDK_API c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer);
FULGUR_SDK_API void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                              const std::string& origin);

// One Lightning-layout dict from parts ("state_dict", "optimizer_states" and the metadata keys),
// and back. split_checkpoint throws fulgur::Error(checkpoint) naming `origin` when the value is
// not a checkpoint dict or holds no "state_dict".
FULGUR_SDK_API c10::IValue join_checkpoint(const CheckpointParts& parts);
FULGUR_SDK_API void split_checkpoint(const c10::IValue& whole, const CheckpointParts& out, const std::string& origin);

}  // namespace fulgur
