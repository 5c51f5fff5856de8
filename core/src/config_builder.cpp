#include <fulgur/config_builder.h>
#include <fulgur/error.h>
#include <fulgur/suggest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "trainer_spellings.h"

namespace fulgur {

namespace {

const OptionSchema& schema_entry(const std::string& key) {
  std::vector<std::string> keys;
  for (const OptionSchema& s : trainer_option_schema()) {
    if (s.key == key) return s;
    keys.push_back(s.key);
  }
  std::string message = fmt::format("ConfigBuilder: unknown [trainer] key '{}'", key);
  if (std::string s = closest_match(key, keys); !s.empty()) message += fmt::format("; did you mean '{}'?", s);
  throw Error(ErrorKind::config, message);
}

bool type_matches(OptionType type, const OptionValue& value) {
  switch (type) {
    case OptionType::boolean:
      return std::holds_alternative<bool>(value);
    case OptionType::integer:
      return std::holds_alternative<int64_t>(value);
    case OptionType::floating:
      return std::holds_alternative<double>(value) || std::holds_alternative<int64_t>(value);
    case OptionType::string:
    case OptionType::path:
      return std::holds_alternative<std::string>(value);
    case OptionType::string_list:
      return std::holds_alternative<std::vector<std::string>>(value);
    case OptionType::float_list:
      return std::holds_alternative<std::vector<double>>(value);
  }
  return false;
}

PluginSelection selection(PluginKind kind, std::string name, Options options) {
  PluginSelection sel;
  sel.kind = kind;
  sel.name = std::move(name);
  sel.where = {"ConfigBuilder", 0, 0};
  sel.given = std::move(options);
  sel.from_code = true;
  return sel;
}

}  // namespace

ConfigBuilder::ConfigBuilder() {
  config_.trainer = Options("[trainer]");
  for (const OptionSchema& s : trainer_option_schema()) config_.trainer.set(s.key, *s.default_value);
  config_.accelerator = selection(PluginKind::accelerator, config_.trainer.get_string("accelerator"), {});
  config_.strategy = selection(PluginKind::strategy, config_.trainer.get_string("strategy"), {});
  config_.precision = selection(PluginKind::precision, config_.trainer.get_string("precision"), {});
}

ConfigBuilder& ConfigBuilder::set(const std::string& key, OptionValue value) {
  const OptionSchema& s = schema_entry(key);
  // Lightning's spellings, as in TOML: fast_dev_run(true), deterministic(true), precision("16").
  if (!type_matches(s.type, value)) {
    std::optional<OptionValue> spelled = lightning_spelling(key, value);
    if (!spelled)
      throw Error(ErrorKind::config, fmt::format("ConfigBuilder: [trainer] {} must be {}, got {}", key,
                                                 to_string(s.type), format_option_value(value)));
    value = std::move(*spelled);
  }
  value = canonical_trainer_value(key, std::move(value));
  config_.trainer.set(key, std::move(value));
  // Where a value came from, for messages, and which keys were given (max_epochs below).
  config_.trainer_locations[key] = SourceLocation{fmt::format("ConfigBuilder: set(\"{}\")", key), 0, 0};
  if (key == "max_steps" && !config_.trainer_locations.contains("max_epochs"))
    config_.trainer.set("max_epochs", default_max_epochs(config_.trainer.get_int("max_steps")));
  if (key == "accelerator") config_.accelerator.name = config_.trainer.get_string(key);
  if (key == "strategy") config_.strategy.name = config_.trainer.get_string(key);
  if (key == "precision") config_.precision.name = config_.trainer.get_string(key);
  return *this;
}

ConfigBuilder& ConfigBuilder::accelerator(std::string name, Options options) {
  set("accelerator", name);
  config_.accelerator = selection(PluginKind::accelerator, std::move(name), std::move(options));
  return *this;
}
ConfigBuilder& ConfigBuilder::strategy(std::string name, Options options) {
  set("strategy", name);
  config_.strategy = selection(PluginKind::strategy, std::move(name), std::move(options));
  return *this;
}
ConfigBuilder& ConfigBuilder::precision(std::string name, Options options) {
  set("precision", name);
  config_.precision = selection(PluginKind::precision, canonical_precision(name), std::move(options));
  return *this;
}
ConfigBuilder& ConfigBuilder::storage(std::string name, Options options) {
  config_.storage = selection(PluginKind::storage, std::move(name), std::move(options));
  return *this;
}

ConfigBuilder& ConfigBuilder::profiler(std::string name, Options options) {
  config_.profiler = selection(PluginKind::profiler, std::move(name), std::move(options));
  return *this;
}
ConfigBuilder& ConfigBuilder::logger(std::string name, Options options) {
  config_.loggers.push_back(selection(PluginKind::logger, std::move(name), std::move(options)));
  config_.loggers.back().selector = "logger";  // `options` may carry the logger's own `name`
  return *this;
}
ConfigBuilder& ConfigBuilder::callback(std::string name, Options options) {
  config_.callbacks.push_back(selection(PluginKind::callback, std::move(name), std::move(options)));
  return *this;
}
ConfigBuilder& ConfigBuilder::plugin_path(std::filesystem::path directory) {
  config_.plugin_paths.push_back(std::filesystem::absolute(directory));
  return *this;
}
ConfigBuilder& ConfigBuilder::model_hparams(Options hparams) {
  config_.model = std::move(hparams);
  return *this;
}
ConfigBuilder& ConfigBuilder::data_hparams(Options hparams) {
  config_.data = std::move(hparams);
  return *this;
}
ConfigBuilder& ConfigBuilder::log_level(std::string level) {
  config_.log_level = std::move(level);
  return *this;
}

}  // namespace fulgur
