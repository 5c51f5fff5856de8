/// @file
/// Typed plugin options (SDK 1.1): a plugin declares its options once, as a struct, and reads them
/// as members instead of by string key.
///
/// @code
///   class EarlyStopping final : public fulgur::Callback {
///    public:
///     FULGUR_OPTIONS(Options,
///                    (string, monitor, "Logged metric to watch"),            // required: no default
///                    (string, mode, "\"min\" or \"max\"", "min"),
///                    (integer, patience, "Checks without improvement", 3));
///     explicit EarlyStopping(const Options& options) : patience_(options.patience) {
///       options.check(options.patience >= 0, "patience", "must be >= 0");  // "... patience = -1 must be >= 0"
///     }
///     ...
///   };
///   FULGUR_PLUGIN(EarlyStopping, "early_stopping", "1.0.0", "Stops when a metric stops improving")
/// @endcode
///
/// FULGUR_OPTIONS(Name, (type, key, help[, default])...) defines the struct `Name` with one member
/// per option, of the C++ type its OptionType reads as (boolean: bool, integer: int64_t, floating:
/// double, string: std::string, string_list: std::vector<std::string>, float_list:
/// std::vector<double>, path (SDK 1.2): std::filesystem::path, absolute: the host resolves a
/// relative TOML value against the file that gave it), and `Name::schema`, the same OptionSpecs
/// FULGUR_OPTION writes. Without a default an option is required. A plugin class with a nested
/// FULGUR_OPTIONS struct called `Options`, and a constructor taking it, needs no option list in
/// FULGUR_PLUGIN: the schema is the struct's, and the host's validated table arrives filled in.
///
/// Errors: `check` and `reject` throw fulgur::Error(config) worded as "<owner>: <key> = <value>
/// <why>" ("callback 'early_stopping': patience = -1 must be >= 0"), where the owner is what the host calls the plugin
/// ("callback 'early_stopping'") and the value is the one the user gave, so a plugin writes no prefix of its own.
///
/// An option may not be called owner, given, check, reject, schema, from or read_members (the
/// struct's own names).
///
/// Everything here is inline (header only): a plugin that uses it records SDK 1.1 and is refused,
/// naming both versions, by a 1.0 host.
#pragma once

#include <fulgur/error.h>
#include <fulgur/option_spec.h>
#include <fulgur/options.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace fulgur {

namespace detail {

/// The C++ type an option of type T reads as.
template <OptionType T>
struct option_cpp_type;
template <>
struct option_cpp_type<OptionType::boolean> {
  using type = bool;
};
template <>
struct option_cpp_type<OptionType::integer> {
  using type = int64_t;
};
template <>
struct option_cpp_type<OptionType::floating> {
  using type = double;
};
template <>
struct option_cpp_type<OptionType::string> {
  using type = std::string;
};
template <>
struct option_cpp_type<OptionType::string_list> {
  using type = std::vector<std::string>;
};
template <>
struct option_cpp_type<OptionType::float_list> {
  using type = std::vector<double>;
};
template <>
struct option_cpp_type<OptionType::path> {
  using type = std::filesystem::path;  // absolute, or empty when not set (SDK 1.2)
};

/// The value of `key` in the host's options, as type T reads it.
template <OptionType T>
typename option_cpp_type<T>::type read_option(const Options& options, std::string_view key) {
  if constexpr (T == OptionType::boolean) return options.get_bool(key);
  if constexpr (T == OptionType::integer) return options.get_int(key);
  if constexpr (T == OptionType::floating) return options.get_float(key);
  if constexpr (T == OptionType::string) return options.get_string(key);
  if constexpr (T == OptionType::string_list) return options.get_string_list(key);
  if constexpr (T == OptionType::float_list) return options.get_float_list(key);
  if constexpr (T == OptionType::path) return std::filesystem::path(options.get_string(key));
}

/// An option's default as its TOML text; none (a required option) is nullptr.
constexpr const char* option_default_text() { return nullptr; }
constexpr const char* option_default_text(const char* text) { return text; }

}  // namespace detail

/// The base of every FULGUR_OPTIONS struct: who the options belong to and the values as given, for
/// errors worded by the SDK.
class PluginOptions {
 public:
  /// Who the options belong to ("callback 'early_stopping'"); empty when built by hand.
  const std::string& owner() const { return given_.owner(); }
  /// The options as the host handed them (every key of the schema, defaults filled in).
  const Options& given() const { return given_; }

  /// Throws fulgur::Error(config): "<owner>: <key> = <value> <why>", the value as given (`why` reads
  /// on from it: "must be >= 0", "is outside 1..1000").
  [[noreturn]] void reject(std::string_view key, std::string_view why) const {
    std::string message = owner().empty() ? std::string() : owner() + ": ";
    message.append(key);
    if (const auto it = given_.values().find(key); it != given_.values().end())
      message.append(" = ").append(format_option_value(it->second));
    message.append(" ").append(why);
    throw Error(ErrorKind::config, message);
  }
  /// reject(key, why) unless `ok`.
  void check(bool ok, std::string_view key, std::string_view why) const {
    if (!ok) reject(key, why);
  }

 protected:
  PluginOptions() = default;
  /// The validated table these options were read from, kept so errors can name the owner.
  Options given_;
};

namespace detail {

/// Whether T declares its options as a nested FULGUR_OPTIONS struct `Options` (FULGUR_PLUGIN and
/// cli_main then build T from it).
template <class T>
concept HasTypedOptions = requires {
  typename T::Options;
}
&&std::is_base_of_v<PluginOptions, typename T::Options>;

/// Derived's members filled from `options` (Derived::read_members), which it keeps for errors.
template <class Derived>
Derived fill_options(const Options& options) {
  Derived out;
  out.read_members(options);
  return out;
}

}  // namespace detail
}  // namespace fulgur

// ---- the preprocessor side of FULGUR_OPTIONS --------------------------------------------------
// FULGUR_PP_FOR_EACH(m, a, b, c) expands to m(a) m(b) m(c), for up to 256 arguments (rescanned
// by nested expansion; __VA_OPT__ ends the recursion).
/// Internal to FULGUR_OPTIONS: `()`, kept apart so FULGUR_PP_FOR_EACH_AGAIN is not expanded at once.
#define FULGUR_PP_PARENS ()
/// Internal to FULGUR_OPTIONS: rescans its argument 256 times (4^4), FULGUR_PP_FOR_EACH's budget.
#define FULGUR_PP_EXPAND(...) FULGUR_PP_EXPAND4(FULGUR_PP_EXPAND4(FULGUR_PP_EXPAND4(FULGUR_PP_EXPAND4(__VA_ARGS__))))
/// Internal to FULGUR_OPTIONS: 64 rescans.
#define FULGUR_PP_EXPAND4(...) FULGUR_PP_EXPAND3(FULGUR_PP_EXPAND3(FULGUR_PP_EXPAND3(FULGUR_PP_EXPAND3(__VA_ARGS__))))
/// Internal to FULGUR_OPTIONS: 16 rescans.
#define FULGUR_PP_EXPAND3(...) FULGUR_PP_EXPAND2(FULGUR_PP_EXPAND2(FULGUR_PP_EXPAND2(FULGUR_PP_EXPAND2(__VA_ARGS__))))
/// Internal to FULGUR_OPTIONS: 4 rescans.
#define FULGUR_PP_EXPAND2(...) FULGUR_PP_EXPAND1(FULGUR_PP_EXPAND1(FULGUR_PP_EXPAND1(FULGUR_PP_EXPAND1(__VA_ARGS__))))
/// Internal to FULGUR_OPTIONS: one rescan.
#define FULGUR_PP_EXPAND1(...) __VA_ARGS__
/// Internal to FULGUR_OPTIONS: FULGUR_PP_FOR_EACH(m, a, b, c) is m(a) m(b) m(c).
#define FULGUR_PP_FOR_EACH(macro, ...) __VA_OPT__(FULGUR_PP_EXPAND(FULGUR_PP_FOR_EACH_STEP(macro, __VA_ARGS__)))
/// Internal to FULGUR_OPTIONS: one step of FULGUR_PP_FOR_EACH, `macro(first)` then the rest.
#define FULGUR_PP_FOR_EACH_STEP(macro, first, ...) \
  macro(first) __VA_OPT__(FULGUR_PP_FOR_EACH_AGAIN FULGUR_PP_PARENS(macro, __VA_ARGS__))
/// Internal to FULGUR_OPTIONS: names FULGUR_PP_FOR_EACH_STEP on the next rescan (recursion).
#define FULGUR_PP_FOR_EACH_AGAIN() FULGUR_PP_FOR_EACH_STEP

// One option entry, (type, key, help[, default]), as a member, a schema entry, a read and a count.
/// Internal to FULGUR_OPTIONS: one option entry as a typed member.
#define FULGUR_OPTIONS_MEMBER(entry) FULGUR_OPTIONS_MEMBER_ entry
/// Internal to FULGUR_OPTIONS: FULGUR_OPTIONS_MEMBER with the entry's parentheses removed.
#define FULGUR_OPTIONS_MEMBER_(option_type, option_key, option_help, ...) \
  ::fulgur::detail::option_cpp_type<::fulgur::OptionType::option_type>::type option_key{};
/// Internal to FULGUR_OPTIONS: one option entry as a fulgur::OptionSpec of the schema.
#define FULGUR_OPTIONS_SPEC(entry) FULGUR_OPTIONS_SPEC_ entry
/// Internal to FULGUR_OPTIONS: FULGUR_OPTIONS_SPEC with the entry's parentheses removed.
#define FULGUR_OPTIONS_SPEC_(option_type, option_key, option_help, ...)             \
  ::fulgur::OptionSpec{::fulgur::OptionType::option_type, #option_key, option_help, \
                       ::fulgur::detail::option_default_text(__VA_OPT__(#__VA_ARGS__))},
/// Internal to FULGUR_OPTIONS: one option entry read from the validated table.
#define FULGUR_OPTIONS_READ(entry) FULGUR_OPTIONS_READ_ entry
/// Internal to FULGUR_OPTIONS: FULGUR_OPTIONS_READ with the entry's parentheses removed.
#define FULGUR_OPTIONS_READ_(option_type, option_key, option_help, ...) \
  option_key = ::fulgur::detail::read_option<::fulgur::OptionType::option_type>(fulgur_given_, #option_key);
/// Internal to FULGUR_OPTIONS: counts one option entry.
#define FULGUR_OPTIONS_COUNT(entry) +1

/// FULGUR_OPTIONS(Name, (type, key, help[, default])...): the struct `Name` holding a plugin's
/// options as typed members, and its `schema`; see the top of this file. `type` is boolean,
/// integer, floating, string, string_list, float_list or path; `key` is written bare; the default
/// is a TOML value (0.5, true, "max", [], nan) and is stored as its text.
#define FULGUR_OPTIONS(Name, ...)                                                                                      \
  struct Name : ::fulgur::PluginOptions {                                                                              \
    FULGUR_PP_FOR_EACH(FULGUR_OPTIONS_MEMBER, __VA_ARGS__)                                                             \
    /** The options' schema, as FULGUR_PLUGIN and `fulgur plugins describe` show it. */                                \
    static constexpr std::array<::fulgur::OptionSpec, 0 FULGUR_PP_FOR_EACH(FULGUR_OPTIONS_COUNT, __VA_ARGS__)> schema{ \
        {FULGUR_PP_FOR_EACH(FULGUR_OPTIONS_SPEC, __VA_ARGS__)}};                                                       \
    /** The struct filled from the host's validated options (every key present, defaults applied). */                  \
    static Name from(const ::fulgur::Options& options) { return ::fulgur::detail::fill_options<Name>(options); }       \
    /** Sets every member from `options` and keeps them for errors. */                                                 \
    void read_members(const ::fulgur::Options& fulgur_given_) {                                                        \
      given_ = fulgur_given_;                                                                                          \
      FULGUR_PP_FOR_EACH(FULGUR_OPTIONS_READ, __VA_ARGS__)                                                             \
    }                                                                                                                  \
  }
