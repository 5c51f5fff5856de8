// The run configuration, read from a TOML file. Every plugin kind is selected by name:
//
//   [plugins]     paths = ["plugins"], allow_writable = false
//   [trainer]     accelerator = "cpu", strategy = "single_device", precision = "32-true", max_epochs...
//   [accelerator] / [strategy] / [precision]   options of the selected plugin
//   [profiler]    name = "simple", then its options
//   [[loggers]]   logger = "csv", then its options, `name` included (repeatable; a table without
//                 `logger` is the old spelling, where `name` selects the plugin)
//   [[callbacks]] name = "model_checkpoint", then its options (repeatable)
//   [model] / [data]   name = "..." selects a model / datamodule plugin, the other keys are its
//                 hyperparameters (checked against its schema); without a name, free-form
//                 hyperparameters handed to the program's own Module / DataModule
//   [links]       model.num_features = "data.num_features": a [model] key set from the datamodule
//
// Several files and command-line overrides layer into one config (load_config(files, overrides)):
// schema defaults < files in order < overrides. to_toml() writes the merged, defaulted result, which
// loads back into the same run.
//
// Loading checks the structure; validate_plugins() then checks each plugin's table against the
// schema its library declares, before any work starts.
#pragma once

#include <fulgur/options.h>
#include <fulgur/registry/metadata.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fulgur {

class PluginRegistry;
class DataModule;

struct SourceLocation {
  std::string file;
  int64_t line = 0;
  int64_t column = 0;
  std::string str() const;  // "file:line:col"
};

// One TOML value before it is checked against a schema.
struct RawOption {
  std::string key;
  SourceLocation where;
  std::shared_ptr<const void> node;  // the toml::node (kept opaque: toml++ stays out of headers)
};

struct PluginSelection {
  PluginKind kind = PluginKind::callback;
  std::string name;
  SourceLocation where;        // where the name was given
  std::vector<RawOption> raw;  // the other keys of its table
  Options options;             // filled by validate_plugins(): typed, defaults applied
  Options given;               // options set in code (ConfigBuilder), checked like `raw`
  bool from_code = false;
  // The key that selected the plugin in its table: "name", or "logger" in [[loggers]] (where
  // `name` is then the logger's own option).
  std::string selector = "name";
};

// One [links] entry: a [model] hyperparameter that takes the datamodule's value (LightningCLI's
// link_arguments): `model.num_features = "data.num_features"`.
struct ConfigLink {
  std::string target;  // the [model] key
  std::string source;  // the datamodule's value (fulgur/data_values.h), else its [data] option
  SourceLocation where;
  OptionType type = OptionType::integer;  // the target's, from the model's schema (validate_plugins)
};

struct Config {
  std::filesystem::path file;                       // empty when built in code
  std::vector<std::filesystem::path> plugin_paths;  // resolved against the TOML's directory
  bool allow_writable_plugins = false;

  Options trainer;  // typed, defaults applied (see trainer_option_schema())
  // Where each [trainer] key was given (value errors point there); empty for keys set in code.
  std::map<std::string, SourceLocation, std::less<>> trainer_locations;
  PluginSelection accelerator;
  PluginSelection strategy;
  PluginSelection precision;
  std::optional<PluginSelection> profiler;
  // [storage]: the storage plugin whose options the table sets (its name is the URL scheme it
  // serves); a URL of another scheme gets that scheme's plugin with its defaults.
  std::optional<PluginSelection> storage;
  std::vector<PluginSelection> loggers;
  // `loggers = []` (or --loggers=[]): no logger, not even the default one (Lightning's logger=[]).
  bool no_loggers = false;
  std::vector<PluginSelection> callbacks;
  // [model] / [data]: with a plugin selected (name non-empty) or a schema applied
  // (apply_hparams_schema), the typed values with defaults; otherwise as given.
  Options model;
  Options data;
  // The model / datamodule plugin that [model] / [data] name (name empty: none); `raw` holds the
  // table's keys either way.
  PluginSelection model_plugin;
  PluginSelection data_plugin;
  // [links]: [model] keys whose values come from the datamodule once it exists (apply_links).
  std::vector<ConfigLink> links;
  std::vector<std::filesystem::path> files;  // every file layered into this config, in order
  std::string log_level;                     // [logging] level, overridden by FULGUR_LOG_LEVEL

  // Every selection in a fixed order: accelerator, strategy, precision, profiler, loggers, callbacks,
  // then the model and datamodule plugins when named.
  std::vector<PluginSelection*> selections();
};

// The [trainer] keys Fulgur understands, with types, defaults and help.
const std::vector<OptionSchema>& trainer_option_schema();

// Parses and structurally validates `file`. Throws fulgur::Error(config) with file:line:col.
Config load_config(const std::filesystem::path& file);
Config parse_config(std::string_view toml_text, const std::filesystem::path& origin);
// Files merged in order (tables merge key by key; arrays such as [[callbacks]] are replaced whole),
// then overrides "section.key=value" (a flag without its "--"): trainer.max_epochs=3, model.lr=3e-4,
// model=gpt (selects the plugin), callbacks.early_stopping.patience=5 (the entry of that plugin),
// loggers=[] / callbacks=[] (replace the whole list; no [[loggers]] at all means no logger).
// A value is TOML if it parses as TOML, else a string. Errors name the file:line:col or the flag.
// Relative paths resolve against the directory of the file that gave them (a flag: the working
// directory).
Config load_config(const std::vector<std::filesystem::path>& files, const std::vector<std::string>& overrides);

// The whole config as TOML: every [trainer] key, every selected plugin with all its options
// (defaults filled), [model] / [data] typed, absolute paths. Loading it gives the same run.
std::string to_toml(const Config& config);

// A program's own Module / DataModule with a schema (fulgur::cli_main): checks [model] / [data]
// against it like a plugin's table and fills `model` / `data` with the typed values.
void apply_hparams_schema(Config& config, PluginKind kind, const std::vector<OptionSchema>& schema,
                          const std::string& owner);

// [links]: sets each linked [model] key (config.model and the model plugin's options) to the
// value `data` offers through the DataValues extension (fulgur/data_values.h), or else to its
// [data] option of that name; the value must fit the key's type. Call after the DataModule is
// created and before the model is. Throws fulgur::Error(config) naming the [links] line.
void apply_links(Config& config, DataModule& data);

// Resolves every selected plugin in `registry` and checks its table against the plugin's schema:
// unknown key (with a suggestion), wrong type (expected and found), missing required key.
void validate_plugins(Config& config, const PluginRegistry& registry);

// Everything `fulgur config check` verifies without training: structure and plugin schemas
// (validate_plugins), every [trainer] value (ranges, enums, durations), and each selected plugin's
// own checks of its option values (its constructor runs; nothing else does), the callbacks that
// [trainer] keys stand for (max_time) included. Throws fulgur::Error with file:line:col on the
// first problem.
void check_config_values(Config& config, const PluginRegistry& registry);

}  // namespace fulgur
