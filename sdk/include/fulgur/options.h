/// @file
/// The options a plugin receives: its TOML table, already validated against the schema it
/// declared (types checked, defaults filled in). Getters throw fulgur::Error naming the owner.
#pragma once

#include <fulgur/abi.h>
#include <fulgur/export.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace fulgur {

/// Type of one option; the same values as fulgur_option_type in the C door.
enum class OptionType : uint32_t {
  boolean = FULGUR_OPTION_BOOL,             ///< bool
  integer = FULGUR_OPTION_INT,              ///< int64_t
  floating = FULGUR_OPTION_FLOAT,           ///< double; an integer in the TOML is accepted
  string = FULGUR_OPTION_STRING,            ///< std::string
  string_list = FULGUR_OPTION_STRING_LIST,  ///< std::vector<std::string>
  float_list = FULGUR_OPTION_FLOAT_LIST,    ///< std::vector<double>
  /// std::string holding an absolute path (SDK 1.2): a relative TOML value is resolved against the
  /// directory of the file that gave it, a command-line override's against the working directory;
  /// "" stays "" (not set). Read it with get_string.
  path = FULGUR_OPTION_PATH,
};

/// The type as a TOML user reads it ("boolean", "float", "array of strings"); "unknown" otherwise.
FULGUR_SDK_API std::string_view to_string(OptionType type);

/// One option's value; the alternative follows the OptionType (floats are stored as double).
using OptionValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>, std::vector<double>>;

/// A plugin's options: key -> value, plus who they belong to for error messages. A plain value
/// type: the host builds it, hands it to the plugin's constructor (valid only during that call;
/// copy what you keep) and keeps no reference to the plugin's copy.
class FULGUR_SDK_API Options {
 public:
  /// No options, no owner.
  Options() = default;
  /// No options yet; `owner` names them in error messages ("callback 'model_checkpoint'").
  explicit Options(std::string owner) : owner_(std::move(owner)) {}

  /// Sets (or replaces) `key`; returns *this for chaining. Does not check the type.
  Options& set(std::string key, OptionValue value);
  /// Whether `key` has a value.
  bool contains(std::string_view key) const;

  /// The value of `key` as that type. Each getter throws fulgur::Error(config) naming the owner and
  /// the key when the key is not set or holds another type.
  bool get_bool(std::string_view key) const;
  /// See get_bool.
  int64_t get_int(std::string_view key) const;
  /// See get_bool; an integer value converts.
  double get_float(std::string_view key) const;
  /// See get_bool. The reference is into these Options.
  const std::string& get_string(std::string_view key) const;
  /// See get_bool. The reference is into these Options.
  const std::vector<std::string>& get_string_list(std::string_view key) const;
  /// See get_bool. The reference is into these Options.
  const std::vector<double>& get_float_list(std::string_view key) const;

  /// Who these options belong to, e.g. "callback 'model_checkpoint'", for error messages.
  const std::string& owner() const { return owner_; }
  /// Every key and value, sorted by key.
  const std::map<std::string, OptionValue, std::less<>>& values() const { return values_; }

 private:
  const OptionValue& at(std::string_view key, std::string_view wanted) const;

  std::string owner_;
  std::map<std::string, OptionValue, std::less<>> values_;
};

/// TOML-style rendering of a value (`true`, `3`, `0.5`, `"max"`, `["a", "b"]`), used for reports
/// and hyperparameter logging.
FULGUR_SDK_API std::string format_option_value(const OptionValue& value);

/// A duration option's text in seconds: "DD:HH:MM:SS", with fewer fields counting from the right
/// ("HH:MM:SS", "MM:SS"), or plain seconds ("3600", "90.5"); every field a finite number >= 0.
/// nullopt for any other text, so that the caller's message can name its own option. Lightning
/// writes Trainer(max_time=...) and Timer(duration=...) this way.
FULGUR_SDK_API std::optional<double> parse_duration(std::string_view text);

}  // namespace fulgur
