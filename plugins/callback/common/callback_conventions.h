// Helpers shared by the built-in callbacks: the "which metric did you mean" error that monitoring
// callbacks raise, Lightning's state_key rendering, and reading/writing callback state as the
// c10::IValue dicts that end up in checkpoint["callbacks"]. Header-only on purpose: each callback
// is its own plugin library and may use only the SDK, so there is no shared library to put it in.
#pragma once

#include <fulgur/error.h>
#include <fulgur/extension.h>
#include <fulgur/storage_root.h>
#include <fulgur/suggest.h>
#include <fulgur/trainer_context.h>
#include <fulgur/types.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <ATen/ops/scalar_tensor.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur::callback_conventions {

// Where a callback's files go by default: `[trainer] default_root_dir` as given when it is a URL
// (StorageRoot, SDK 1.6), else TrainerContext::default_root_dir() (local).
inline std::string default_root(TrainerContext& trainer) {
  if (const auto* root = find_extension<StorageRoot>(trainer); root && !root->default_root_url().empty())
    return root->default_root_url();
  return trainer.default_root_dir();
}

enum class MonitorMode { min, max };

inline MonitorMode parse_mode(std::string_view owner, std::string_view mode) {
  if (mode == "min") return MonitorMode::min;
  if (mode == "max") return MonitorMode::max;
  throw Error(ErrorKind::config, fmt::format("{}: mode = \"{}\" is not understood; use \"min\" (lower is better, "
                                             "e.g. a loss) or \"max\" (higher is better, e.g. an accuracy)",
                                             owner, mode));
}

inline const char* to_string(MonitorMode mode) { return mode == MonitorMode::min ? "min" : "max"; }

// "Strictly better": NaN is never better than anything, as with torch.lt / torch.gt.
inline bool is_better(MonitorMode mode, double candidate, double reference) {
  return mode == MonitorMode::min ? candidate < reference : candidate > reference;
}

// The score a mode starts from, so that any finite first value improves on it.
inline double worst_score(MonitorMode mode) {
  return mode == MonitorMode::min ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
}

// Same edit-distance threshold as the registry's "did you mean", so suggestions feel alike. Metric
// names are also often shortened ("val/acc" for "val/accuracy"), so failing that, the shortest
// name that contains the word (or is contained in it) is suggested.
inline std::string closest_match(std::string_view word, const std::vector<std::string>& choices) {
  std::string best = ::fulgur::closest_match(word, choices);
  if (!best.empty() || word.size() < 3) return best;
  for (const auto& choice : choices) {
    if (choice.size() < 3) continue;
    bool related = choice.find(word) != std::string::npos || word.find(choice) != std::string_view::npos;
    if (related && (best.empty() || choice.size() < best.size())) best = choice;
  }
  return best;
}

// Python's repr(float): shortest round-trip digits, with ".0" on integral values ("5.0"), as the
// Lightning messages and file names that print Python numbers show them.
inline std::string python_float_repr(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find_first_not_of("-0123456789") == std::string::npos) text += ".0";
  return text;
}

// The error for a monitored metric that nobody logged: names the metric, lists what is there, and
// suggests the closest name, since a typo ("val_loss" vs "val/loss") is the usual cause.
inline Error missing_metric_error(std::string_view owner, std::string_view metric, std::vector<std::string> available) {
  std::sort(available.begin(), available.end());
  std::string listed;
  for (const auto& key : available) listed += fmt::format("{}\"{}\"", listed.empty() ? "" : ", ", key);
  if (listed.empty()) listed = "none (nothing has been logged yet)";
  std::string suggestion = closest_match(metric, available);
  return Error(
      ErrorKind::config,
      fmt::format("{}: the monitored metric \"{}\" was not found in the logged metrics. Available: {}.{} "
                  "Log it from the Module with log(\"{}\", value) or change `monitor` in the callback's "
                  "table.",
                  owner, metric, listed,
                  suggestion.empty() ? std::string{} : fmt::format(" Did you mean \"{}\"?", suggestion), metric));
}

inline std::vector<std::string> metric_names(const MetricMap& metrics) {
  std::vector<std::string> names;
  names.reserve(metrics.size());
  for (const auto& [name, value] : metrics) names.push_back(name);
  return names;
}

// Python's repr() of a str, as Lightning's state_key embeds it ("ModelCheckpoint{'monitor': ...}").
inline std::string python_repr(std::string_view text) {
  bool has_single = text.find('\'') != std::string_view::npos;
  bool has_double = text.find('"') != std::string_view::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char c : text) {
    if (c == '\\' || c == quote) out += '\\';
    out += c;
  }
  out += quote;
  return out;
}

inline std::string python_repr_or_none(std::string_view text) {
  return text.empty() ? std::string("None") : python_repr(text);
}

// --- checkpoint state ---------------------------------------------------------------------------

inline c10::impl::GenericDict new_state_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

// Scores are stored as 0-dim float64 tensors, as Lightning stores tensors there, so Python's
// torch.load reads them as it would a Lightning checkpoint and the value round-trips exactly.
inline c10::IValue score_value(double score) { return c10::IValue(at::scalar_tensor(score, at::kDouble)); }

inline c10::IValue optional_score_value(const std::optional<double>& score) {
  return score ? score_value(*score) : c10::IValue();
}

inline c10::impl::GenericDict expect_dict(std::string_view owner, const c10::IValue& state) {
  if (!state.isGenericDict())
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: the checkpoint's callback state is a {}, not a dict; the file was not written by "
                            "this callback",
                            owner, state.tagKind()));
  return state.toGenericDict();
}

inline std::optional<c10::IValue> find_value(const c10::impl::GenericDict& dict, const std::string& key) {
  auto it = dict.find(key);
  if (it == dict.end()) return std::nullopt;
  return it->value();
}

// A number stored by us (tensor) or by hand (float / int); nullopt for None or a missing key.
inline std::optional<double> to_optional_double(std::string_view owner, std::string_view key, const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.numel() != 1)
      throw Error(ErrorKind::checkpoint,
                  fmt::format("{}: state '{}' holds a tensor of {} elements, expected one", owner, key, t.numel()));
    return t.item<double>();
  }
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  throw Error(ErrorKind::checkpoint,
              fmt::format("{}: state '{}' holds a {}, expected a number", owner, key, v.tagKind()));
}

inline std::optional<double> get_optional_double(std::string_view owner, const c10::impl::GenericDict& dict,
                                                 const std::string& key) {
  auto v = find_value(dict, key);
  return v ? to_optional_double(owner, key, *v) : std::nullopt;
}

inline std::optional<int64_t> get_optional_int(std::string_view owner, const c10::impl::GenericDict& dict,
                                               const std::string& key) {
  auto v = find_value(dict, key);
  if (!v || v->isNone()) return std::nullopt;
  if (v->isInt()) return v->toInt();
  if (auto d = to_optional_double(owner, key, *v)) return static_cast<int64_t>(*d);
  return std::nullopt;
}

// Strings are read leniently: Lightning writes None for paths that were never set.
inline std::optional<std::string> get_optional_string(std::string_view owner, const c10::impl::GenericDict& dict,
                                                      const std::string& key) {
  auto v = find_value(dict, key);
  if (!v || v->isNone()) return std::nullopt;
  if (!v->isString())
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: state '{}' holds a {}, expected a string", owner, key, v->tagKind()));
  return v->toStringRef();
}

}  // namespace fulgur::callback_conventions
