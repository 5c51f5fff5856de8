// Conversion of TOML values to plugin option values, shared by the registry (schema defaults)
// and the config loader (user values). Include only in .cpp files: it pulls in toml++.
#pragma once

#include <fulgur/options.h>

#include <toml++/toml.h>

#include <string>

namespace fulgur {

// TOML's own name for the node's type ("integer", "string", "array", "table", ...).
std::string toml_type_name(const toml::node& node);

// Converts `node` to `type`; integers are accepted where floats are expected. On mismatch returns
// nullopt and sets `found` to a description of what the node is.
std::optional<OptionValue> toml_to_option(const toml::node& node, OptionType type, std::string& found);

}  // namespace fulgur
