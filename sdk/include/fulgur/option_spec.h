/// @file
/// Option and hyperparameter schemas written next to the code they configure, as constexpr data.
/// FULGUR_PLUGIN (fulgur/plugin.h) stores them in a plugin's metadata; fulgur::cli_main
/// (fulgur/cli.h) reads a Module's or DataModule's hparams_schema without any plugin machinery.
#pragma once

#include <fulgur/options.h>

#include <fulgur/export.h>

#include <array>
#include <cstddef>
#include <span>
#include <string_view>

namespace fulgur {

/// One TOML key of a plugin. Every string is a literal (static storage): the schema is constexpr
/// data copied into the plugin's descriptor and ELF note. Write it with FULGUR_OPTION.
struct OptionSpec {
  OptionType type;            ///< what the TOML value must be
  const char* key;            ///< the TOML key
  const char* help;           ///< one line for `fulgur plugins list` and messages
  const char* default_value;  ///< TOML value text; nullptr = required key
};

/// FULGUR_OPTION(type, key, help, default): an OptionSpec. `type` is boolean, integer, floating,
/// string, string_list, float_list or path (SDK 1.2: a string the host makes absolute); `key` is
/// written bare (it is stringized); the default is written as a TOML value: 0.5, true, "max", [].
#define FULGUR_OPTION(type, key, help, ...) \
  ::fulgur::OptionSpec { ::fulgur::OptionType::type, #key, help, #__VA_ARGS__ }
/// FULGUR_REQUIRED_OPTION(type, key, help): an OptionSpec without a default; a TOML table that
/// selects the plugin must set it.
#define FULGUR_REQUIRED_OPTION(type, key, help) \
  ::fulgur::OptionSpec { ::fulgur::OptionType::type, #key, help, nullptr }

/// A class's hyperparameters declared once, next to the class, as its schema:
///
/// @code
///   struct Net : fulgur::Module {
///     static constexpr auto hparams_schema = fulgur::option_schema(
///         FULGUR_OPTION(floating, lr, "Learning rate", 1e-3));
///     explicit Net(const fulgur::Options& hp);
///   };
///   FULGUR_PLUGIN(Net, "net", "1.0.0", "A small net")   // no options given: the schema above
/// @endcode
///
/// fulgur::cli_main<Net, Data> reads the same schema, so a program built without plugins checks and
/// defaults [model] exactly as `fulgur fit` does.
template <class... O>
constexpr auto option_schema(O... options) {
  return std::array<OptionSpec, sizeof...(O)>{options...};
}

/// A class built in code with options it was handed (no registry in between), checked against its
/// hparams_schema as `fulgur fit` checks a plugin's table: every key of `schema` present, given
/// values kept as they are, the others from their defaults, so that checkpoints and loggers see
/// the values actually used (Lightning's save_hyperparameters). A key the schema lacks, or a
/// missing required one, throws fulgur::Error(config) naming the owner (`given.owner()`, else
/// `fallback_owner`, e.g. "[model]"), with a suggestion. Types are checked by the getters.
///
///   explicit Net(const fulgur::Options& hp) : Module() {
///     hparams = fulgur::with_defaults(hp, hparams_schema, "[model]");
///   }
FULGUR_SDK_API Options with_defaults(const Options& given, std::span<const OptionSpec> schema,
                                     std::string_view fallback_owner);

}  // namespace fulgur
