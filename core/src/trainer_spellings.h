// Lightning's other spellings of [trainer] values, turned into the one form the rest of the core
// reads (config.cpp applies them to TOML and command-line values, config_builder.cpp to values set
// in code).
#pragma once

#include <fulgur/options.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fulgur {

/// The precision plugin a Lightning precision spelling means (the aliases the build's plugins
/// declare, e.g. 16 for 16-mixed); any other name unchanged.
std::string canonical_precision(std::string_view name);

/// `value` of [trainer] `key` in one of Lightning's spellings that the key's schema type does not
/// hold (fast_dev_run = true, precision = 16, deterministic = true, check_val_every_n_epoch =
/// "none", a wall-clock val_check_interval "DD:HH:MM:SS"), as the value the key holds; nullopt for
/// anything else. TOML values and ConfigBuilder::set go through this one function.
std::optional<OptionValue> lightning_spelling(std::string_view key, const OptionValue& value);

/// Lightning's max_epochs = None: 1000 epochs, or no epoch limit (-1) when max_steps is given.
int64_t default_max_epochs(int64_t max_steps);

/// `value` of [trainer] `key` in its canonical form (today: precision names, as above).
OptionValue canonical_trainer_value(std::string_view key, OptionValue value);

}  // namespace fulgur
