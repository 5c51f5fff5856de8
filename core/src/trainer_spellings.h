// Lightning's other spellings of [trainer] values, turned into the one form the rest of the core
// reads (config.cpp applies them to TOML and command-line values, config_builder.cpp to values set
// in code).
#pragma once

#include <fulgur/options.h>

#include <string>
#include <string_view>

namespace fulgur {

/// The precision plugin a Lightning precision spelling means (the aliases the build's plugins
/// declare, e.g. 16 for 16-mixed); any other name unchanged.
std::string canonical_precision(std::string_view name);

/// `value` of [trainer] `key` in its canonical form (today: precision names, as above).
OptionValue canonical_trainer_value(std::string_view key, OptionValue value);

}  // namespace fulgur
