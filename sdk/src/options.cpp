#include <fulgur/error.h>
#include <fulgur/option_spec.h>
#include <fulgur/options.h>
#include <fulgur/suggest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace fulgur {

std::string_view to_string(OptionType type) {
  switch (type) {
    case OptionType::boolean:
      return "boolean";
    case OptionType::integer:
      return "integer";
    case OptionType::floating:
      return "float";
    case OptionType::string:
      return "string";
    case OptionType::string_list:
      return "array of strings";
    case OptionType::float_list:
      return "array of floats";
    case OptionType::path:
      return "path";
  }
  return "unknown";
}

Options& Options::set(std::string key, OptionValue value) {
  values_.insert_or_assign(std::move(key), std::move(value));
  return *this;
}

bool Options::contains(std::string_view key) const { return values_.find(key) != values_.end(); }

const OptionValue& Options::at(std::string_view key, std::string_view wanted) const {
  auto it = values_.find(key);
  if (it == values_.end())
    throw Error(ErrorKind::config, fmt::format("{}: option '{}' ({}) is not set; declare it in the plugin's "
                                               "schema with a default or set it in the TOML table",
                                               owner_.empty() ? "options" : owner_, key, wanted));
  return it->second;
}

namespace {
template <class T>
const T& get_as(const Options& options, const OptionValue& value, std::string_view key, std::string_view wanted) {
  if (const T* v = std::get_if<T>(&value)) return *v;
  throw Error(ErrorKind::config,
              fmt::format("{}: option '{}' holds {}, not {}", options.owner().empty() ? "options" : options.owner(),
                          key, format_option_value(value), wanted));
}
}  // namespace

bool Options::get_bool(std::string_view key) const { return get_as<bool>(*this, at(key, "boolean"), key, "a boolean"); }
int64_t Options::get_int(std::string_view key) const {
  return get_as<int64_t>(*this, at(key, "integer"), key, "an integer");
}
double Options::get_float(std::string_view key) const {
  const OptionValue& v = at(key, "float");
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  return get_as<double>(*this, v, key, "a float");
}
const std::string& Options::get_string(std::string_view key) const {
  return get_as<std::string>(*this, at(key, "string"), key, "a string");
}
const std::vector<std::string>& Options::get_string_list(std::string_view key) const {
  return get_as<std::vector<std::string>>(*this, at(key, "array of strings"), key, "an array of strings");
}
const std::vector<double>& Options::get_float_list(std::string_view key) const {
  return get_as<std::vector<double>>(*this, at(key, "array of floats"), key, "an array of floats");
}

std::string format_option_value(const OptionValue& value) {
  struct Visitor {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return fmt::format("{}", i); }
    std::string operator()(double d) const { return fmt::format("{}", d); }
    std::string operator()(const std::string& s) const { return fmt::format("\"{}\"", s); }
    std::string operator()(const std::vector<std::string>& l) const {
      std::vector<std::string> quoted;
      for (const auto& s : l) quoted.push_back(fmt::format("\"{}\"", s));
      return fmt::format("[{}]", fmt::join(quoted, ", "));
    }
    std::string operator()(const std::vector<double>& l) const { return fmt::format("[{}]", fmt::join(l, ", ")); }
  };
  return std::visit(Visitor{}, value);
}

std::optional<double> parse_duration(std::string_view text) {
  std::vector<double> fields;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(':', start);
    const std::string field(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    try {
      size_t used = 0;
      const double value = std::stod(field, &used);
      if (used != field.size() || !std::isfinite(value) || value < 0) return std::nullopt;
      fields.push_back(value);
    } catch (const std::exception&) {  // empty, or not a number
      return std::nullopt;
    }
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  if (fields.size() > 4) return std::nullopt;
  constexpr double kScale[] = {1, 60, 3600, 86400};  // seconds, minutes, hours, days from the right
  double seconds = 0;
  for (size_t i = 0; i < fields.size(); ++i) seconds += fields[fields.size() - 1 - i] * kScale[i];
  return seconds;
}

namespace {

// A schema default is TOML value text of a few simple shapes (what FULGUR_OPTION stringifies):
// true, 64, 1e-3, "text", [0.9, 0.99], ["a", "b"]. The registry reads the same text with a full
// TOML parser; classes built in code read it here, without one.
std::string unquote(std::string_view text) {
  std::string out;
  for (size_t i = 1; i + 1 < text.size(); ++i) {
    if (text[i] != '\\' || i + 2 >= text.size()) {
      out += text[i];
      continue;
    }
    switch (text[++i]) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      default:
        out += text[i];  // \\ and \"
    }
  }
  return out;
}

// The items of "[a, b, c]", split at the commas outside quotes, each trimmed.
std::vector<std::string_view> list_items(std::string_view text) {
  std::vector<std::string_view> items;
  const std::string_view inner = text.substr(1, text.size() - 2);
  bool quoted = false;
  size_t start = 0;
  for (size_t i = 0; i <= inner.size(); ++i) {
    if (i < inner.size() && inner[i] == '"' && (i == 0 || inner[i - 1] != '\\')) quoted = !quoted;
    if (i < inner.size() && (quoted || inner[i] != ',')) continue;
    std::string_view item = inner.substr(start, i - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) items.push_back(item);
    start = i + 1;
  }
  return items;
}

OptionValue parse_default(const OptionSpec& spec) {
  const std::string_view text = spec.default_value;
  switch (spec.type) {
    case OptionType::boolean:
      return text == "true";
    case OptionType::integer:
      return static_cast<int64_t>(std::stoll(std::string(text)));
    case OptionType::floating:
      return std::stod(std::string(text));
    case OptionType::string:
    case OptionType::path:
      return unquote(text);
    case OptionType::string_list: {
      std::vector<std::string> out;
      for (std::string_view item : list_items(text)) out.push_back(unquote(item));
      return out;
    }
    case OptionType::float_list: {
      std::vector<double> out;
      for (std::string_view item : list_items(text)) out.push_back(std::stod(std::string(item)));
      return out;
    }
  }
  throw Error(ErrorKind::runtime, fmt::format("option '{}': unknown type", spec.key));
}

}  // namespace

Options with_defaults(const Options& given, std::span<const OptionSpec> schema, std::string_view fallback_owner) {
  const std::string owner = given.owner().empty() ? std::string(fallback_owner) : given.owner();
  std::vector<std::string> known;
  for (const OptionSpec& spec : schema) known.emplace_back(spec.key);
  for (const auto& [key, value] : given.values()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string message = fmt::format("{}: unknown key '{}'", owner, key);
    // One sentence, then the list: "...; did you mean 'x'? Known keys: ..." or "...'. Known keys: ...".
    if (std::string s = closest_match(key, known); !s.empty())
      message += fmt::format("; did you mean '{}'?", s);
    else
      message += '.';
    throw Error(ErrorKind::config, message + fmt::format(" Known keys: {}.", fmt::join(known, ", ")));
  }
  Options out(owner);
  for (const OptionSpec& spec : schema) {
    if (auto it = given.values().find(spec.key); it != given.values().end())
      out.set(spec.key, it->second);
    else if (spec.default_value)
      out.set(spec.key, parse_default(spec));
    else
      throw Error(ErrorKind::config, fmt::format("{}: required key '{}' ({}) is missing: {}", owner, spec.key,
                                                 to_string(spec.type), spec.help));
  }
  return out;
}

}  // namespace fulgur
