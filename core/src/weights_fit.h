// Internal: the key mapping and fit check of fulgur::load_weights without the copy, so that the
// Trainer can hand the result to its strategy (which may shard the model) and name its own
// config keys in the hints: [trainer] init_weights and weights-only --ckpt_path files.
#pragma once

#include <fulgur/weights.h>

#include <ATen/core/Dict.h>

#include <string>

namespace fulgur::detail {

// How the fixes are spelled in a refusal: load_weights' option calls, or config keys. Each is a
// fmt pattern; {} is the prefix for the two prefix hints.
struct WeightsHintSpelling {
  std::string strip_prefix = "strip_prefix(\"{}\")";
  std::string add_prefix = "add_prefix(\"{}\")";
  std::string not_strict = "strict(false)";
  std::string skip_mismatched = "skip_mismatched(true)";
};

// A state dict of the keys that fit: `tensors` renamed by `options` (strip_prefix, map_keys,
// add_prefix) and compared with `targets` (the module's names and shapes). `report` receives what
// matched and what did not. Throws fulgur::Error(checkpoint) as load_weights does, naming `origin`,
// `module_name` and, when the keys differ by a prefix, the option that fixes it.
c10::impl::GenericDict fit_weights(const TensorMap& targets, const TensorMap& tensors,
                                   const LoadWeightsOptions& options, const std::string& origin,
                                   const std::string& module_name, LoadReport& report,
                                   const WeightsHintSpelling& spelling = {});

}  // namespace fulgur::detail
