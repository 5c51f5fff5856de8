// The fsdp strategy's auto-wrap policies (FSDP's auto_wrap_policy, Lightning's `auto_wrap_policy`):
// which submodules of a model become ZeRO-3 units besides the blocks the Module runs through
// fulgur::run_block.
//
// LibTorch's C++ modules have no forward hooks: a strategy cannot run code around a submodule's
// forward that the model's own code calls (`fc1->forward(x)`). It can around one that a
// torch::nn::Sequential calls: the Sequential holds its elements as AnyModules, and the policy
// replaces a selected element's entry by a forwarding module that runs it through fulgur::run_block
// (the element stays registered under its name, so parameter names and checkpoints do not change).
// Such a unit is a block like any other: gathered around its forward, freed after it, gathered
// again for its backward, its gradients reduce-scattered as soon as its backward is done. A
// selected submodule no Sequential calls cannot be made a unit, and the policy refuses it, naming
// it and the fix.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fulgur::fsdp {

/// Which submodules become units.
struct AutoWrapPolicy {
  enum class Kind {
    blocks,   // only the Module's fulgur::run_block blocks; refused when they hold no parameter
    root,     // the same, and parameters outside blocks may stay whole (FSDP's root unit) without refusal
    size,     // also every submodule holding at least min_params parameters not in a smaller unit
    modules,  // also every submodule of one of the classes in `modules`
  };
  Kind kind = Kind::blocks;
  int64_t min_params = 100'000'000;  // size_based_auto_wrap_policy's default min_num_params
  std::vector<std::string> modules;  // class names: "torch::nn::Linear", "Linear", "BlockImpl", "Block"
};

/// What auto_wrap did.
struct AutoWrapped {
  int64_t units = 0;  // submodules routed through fulgur::run_block (this call or an earlier one)
};

/// Selects `model`'s submodules by `policy` and routes each selected element of a
/// torch::nn::Sequential through fulgur::run_block (again on later stages: idempotent). Throws
/// fulgur::Error(config) naming a selected submodule that no Sequential calls, or a policy that
/// selects nothing.
AutoWrapped auto_wrap(torch::nn::Module& model, const AutoWrapPolicy& policy);

/// Whether `module`'s class is `name`: its full C++ name ("torch::nn::LinearImpl"), without the
/// "Impl" of a TORCH_MODULE ("torch::nn::Linear"), or the last part of either ("LinearImpl",
/// "Linear").
bool class_matches(const torch::nn::Module& module, const std::string& name);

}  // namespace fulgur::fsdp
