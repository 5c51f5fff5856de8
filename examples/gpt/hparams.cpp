// The GPT example's hyperparameter tables made into Options (defaults filled in, unknown keys
// refused), and the byte tokenizer.
#include "gpt.h"

#include <fulgur/error.h>
#include <fulgur/suggest.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

namespace fulgur::examples {

namespace {

// The default texts in the tables are TOML values of a few simple shapes; parsing them here keeps
// the tables the single source of every default.
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

std::vector<double> parse_float_list(std::string_view text) {
  std::vector<double> out;
  std::string inner(text.substr(1, text.size() - 2));
  for (char& c : inner)
    if (c == ',') c = ' ';
  const char* p = inner.c_str();
  char* end = nullptr;
  for (double v = std::strtod(p, &end); end != p; v = std::strtod(p, &end)) {
    out.push_back(v);
    p = end;
  }
  return out;
}

OptionValue parse_default(const HyperParam& h) {
  const std::string_view text = h.default_value;
  switch (h.type) {
    case OptionType::boolean:
      return text == "true";
    case OptionType::integer:
      return static_cast<int64_t>(std::stoll(std::string(text)));
    case OptionType::floating:
      return std::stod(std::string(text));
    case OptionType::string:
      return unquote(text);
    case OptionType::float_list:
      return parse_float_list(text);
    case OptionType::string_list:
      break;  // no table uses one
  }
  throw Error(ErrorKind::runtime, fmt::format("hyperparameter '{}': unsupported default type", h.key));
}

}  // namespace

Options with_defaults(const Options& given, std::span<const HyperParam> table, std::string_view fallback_owner) {
  const std::string owner = given.owner().empty() ? std::string(fallback_owner) : given.owner();
  std::vector<std::string> known;
  for (const HyperParam& h : table) known.emplace_back(h.key);
  for (const auto& [key, value] : given.values()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string message = fmt::format("{}: unknown key '{}'", owner, key);
    if (std::string s = closest_match(key, known); !s.empty()) message += fmt::format("; did you mean '{}'?", s);
    throw Error(ErrorKind::config, message + fmt::format(" Known keys: {}.", fmt::join(known, ", ")));
  }
  // Lightning's save_hyperparameters records defaults too: checkpoints and loggers see the values
  // actually used.
  Options out(owner);
  for (const HyperParam& h : table) {
    if (given.contains(h.key))
      out.set(h.key, given.values().find(h.key)->second);
    else
      out.set(h.key, parse_default(h));
  }
  return out;
}

at::Tensor encode_bytes(std::string_view text) {
  at::Tensor tokens = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string decode_bytes(const at::Tensor& tokens) {
  const at::Tensor t = tokens.to(at::kLong).contiguous().view({-1});
  const int64_t* in = t.data_ptr<int64_t>();
  std::string text(static_cast<size_t>(t.numel()), '\0');
  for (int64_t i = 0; i < t.numel(); ++i) text[static_cast<size_t>(i)] = static_cast<char>(in[i] & 0xff);
  return text;
}

}  // namespace fulgur::examples
