// The options a plugin receives: its TOML table, already validated against the schema it
// declared (types checked, defaults filled in). Getters throw fulgur::Error naming the owner.
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

enum class OptionType : uint32_t {
  boolean = FULGUR_OPTION_BOOL,
  integer = FULGUR_OPTION_INT,
  floating = FULGUR_OPTION_FLOAT,
  string = FULGUR_OPTION_STRING,
  string_list = FULGUR_OPTION_STRING_LIST,
  float_list = FULGUR_OPTION_FLOAT_LIST,
};

FULGUR_SDK_API std::string_view to_string(OptionType type);

using OptionValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>, std::vector<double>>;

class FULGUR_SDK_API Options {
 public:
  Options() = default;
  explicit Options(std::string owner) : owner_(std::move(owner)) {}

  Options& set(std::string key, OptionValue value);
  bool contains(std::string_view key) const;

  bool get_bool(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  double get_float(std::string_view key) const;  // integers convert
  const std::string& get_string(std::string_view key) const;
  const std::vector<std::string>& get_string_list(std::string_view key) const;
  const std::vector<double>& get_float_list(std::string_view key) const;

  // Who these options belong to, e.g. "callback 'model_checkpoint'", for error messages.
  const std::string& owner() const { return owner_; }
  const std::map<std::string, OptionValue, std::less<>>& values() const { return values_; }

 private:
  const OptionValue& at(std::string_view key, std::string_view wanted) const;

  std::string owner_;
  std::map<std::string, OptionValue, std::less<>> values_;
};

// TOML-style rendering of a value, used for reports and hyperparameter logging.
FULGUR_SDK_API std::string format_option_value(const OptionValue& value);

/// A duration option's text in seconds: "DD:HH:MM:SS", with fewer fields counting from the right
/// ("HH:MM:SS", "MM:SS"), or plain seconds ("3600", "90.5"); every field a finite number >= 0.
/// nullopt for any other text, so that the caller's message can name its own option. Lightning
/// writes Trainer(max_time=...) and Timer(duration=...) this way.
FULGUR_SDK_API std::optional<double> parse_duration(std::string_view text);

}  // namespace fulgur
