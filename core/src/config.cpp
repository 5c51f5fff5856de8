// TOML configuration: structure checks at load time, plugin option checks against the schemas
// read from the plugins' metadata (no plugin code runs before the whole config is known good).
#include <fulgur/accelerator.h>
#include <fulgur/builtin_plugins.h>
#include <fulgur/config.h>
#include <fulgur/error.h>
#include <fulgur/registry/registry.h>
#include <fulgur/registry/toml_options.h>
#include <fulgur/storage.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "trainer_spellings.h"

namespace fulgur {

namespace fs = std::filesystem;

std::string SourceLocation::str() const {
  // A value from a command-line flag is located by the flag itself ("--trainer.max_epochs=x").
  if (line <= 0 || file.starts_with("--")) return file;
  return fmt::format("{}:{}:{}", file, line, column);
}

std::vector<PluginSelection*> Config::selections() {
  std::vector<PluginSelection*> out{&accelerator, &strategy, &precision};
  if (profiler) out.push_back(&*profiler);
  if (storage) out.push_back(&*storage);
  for (auto& l : loggers) out.push_back(&l);
  for (auto& c : callbacks) out.push_back(&c);
  if (!model_plugin.name.empty()) out.push_back(&model_plugin);
  if (!data_plugin.name.empty()) out.push_back(&data_plugin);
  return out;
}

namespace {
// The default of a [trainer] key that names a plugin, as TOML text, from the build's list.
std::string plugin_default(std::string_view key) {
  for (const builtin::TrainerDefault& d : builtin::kTrainerDefaults)
    if (d.key == key) return fmt::format("\"{}\"", d.name);
  return "\"\"";
}
}  // namespace

const std::vector<OptionSchema>& trainer_option_schema() {
  static const std::vector<OptionSchema> schema = [] {
    struct Row {
      const char* key;
      OptionType type;
      std::string default_text;
      const char* help;
    };
    using T = OptionType;
    const Row rows[] = {
        {"accelerator", T::string, plugin_default("accelerator"),
         "Accelerator plugin by name (fulgur plugins list), \"auto\" (cuda when a GPU is visible, else cpu) or "
         "\"gpu\" (the available accelerator of highest priority that is not the cpu)"},
        {"strategy", T::string, plugin_default("strategy"), "Strategy plugin by name (fulgur plugins list)"},
        {"precision", T::string, plugin_default("precision"),
         "Precision plugin by name (fulgur plugins list), or one of Lightning's short forms that a plugin declares "
         "(16, \"bf16\", 32, 64)"},
        {"devices", T::string, "\"auto\"", "Devices per node: a count, \"auto\", -1 (all) or \"0,1\""},
        {"num_nodes", T::integer, "1",
         "Number of nodes (0: as many as the launcher started, e.g. torchrun --nnodes=MIN:MAX)"},
        {"max_epochs", T::integer, "1000",
         "Stop after this many epochs (-1: no epoch limit; when not given: 1000, or no limit if max_steps is set)"},
        {"min_epochs", T::integer, "0", "Do not stop early before this many epochs"},
        {"max_steps", T::integer, "-1", "Stop after this many optimizer steps (-1: no limit)"},
        {"min_steps", T::integer, "0", "Do not stop early before this many optimizer steps"},
        {"max_time", T::string, "\"\"", "Stop after this wall time, \"DD:HH:MM:SS\" (empty: no limit)"},
        {"limit_train_batches", T::floating, "1.0", "Fraction (float) or count (integer) of training batches"},
        {"limit_val_batches", T::floating, "1.0", "Fraction (float) or count (integer) of validation batches"},
        {"limit_test_batches", T::floating, "1.0", "Fraction (float) or count (integer) of test batches"},
        {"limit_predict_batches", T::floating, "1.0", "Fraction (float) or count (integer) of predict batches"},
        {"overfit_batches", T::floating, "0.0", "Train and validate on this fraction/count of training batches"},
        {"val_check_interval", T::floating, "1.0",
         "Validate every fraction of an epoch (float), N batches (integer) or a wall-clock interval "
         "(\"DD:HH:MM:SS\")"},
        {"check_val_every_n_epoch", T::integer, "1",
         "Validate every N epochs; 0 or \"none\": no epoch condition (val_check_interval counts batches across "
         "epochs, Lightning's None)"},
        {"use_distributed_sampler", T::boolean, "true",
         "Give each data-parallel rank its own share of every loader (false: each rank reads all of it, as the "
         "DataModule's loaders shard themselves)"},
        {"reload_dataloaders_every_n_epochs", T::integer, "0",
         "Ask the DataModule for new train and val loaders every N epochs (0: once per fit)"},
        {"num_sanity_val_steps", T::integer, "2", "Validation batches run before training (-1: all)"},
        {"log_every_n_steps", T::integer, "50", "Send step-level metrics to loggers every N steps"},
        {"accumulate_grad_batches", T::integer, "1", "Accumulate gradients over N batches per optimizer step"},
        {"gradient_clip_val", T::floating, "0.0", "Clip gradients at this value (0: off)"},
        {"gradient_clip_algorithm", T::string, "\"norm\"", "\"norm\" or \"value\""},
        {"deterministic", T::string, "\"false\"",
         "Use deterministic algorithms: true, false or \"warn\" (nondeterministic kernels warn instead of failing)"},
        {"cuda_graphs", T::string, "\"off\"",
         "Capture the training step as a CUDA graph and replay it: \"off\", \"on\" (a step that cannot be "
         "captured ends the run) or \"try\" (it trains uncaptured, with a warning)"},
        {"seed", T::integer, "-1", "Seed for torch and data order (-1: not seeded)"},
        {"fast_dev_run", T::integer, "0",
         "Run N batches of each stage once, without loggers/checkpoints (0 or false: off; true: 1)"},
        {"default_root_dir", T::string, "\".\"",
         "Where logs and checkpoints go (relative to the TOML file); a URL (s3://bucket/prefix): checkpoints "
         "and the csv/tensorboard loggers' files go there, other files to staging_dir"},
        {"staging_dir", T::string, "\".\"",
         "With a URL default_root_dir only: the local directory for files that stay on this machine (logs "
         "staged before each upload, profiler traces, finder results); relative to the TOML file"},
        {"enable_checkpointing", T::boolean, "true",
         "Add the default checkpoint callback if no checkpoint callback is configured"},
        {"enable_progress_bar", T::boolean, "true", "Add the default progress bar callback if none is configured"},
        {"enable_model_summary", T::boolean, "true", "Add the default model summary callback if none is configured"},
        {"inference_mode", T::boolean, "true", "Evaluate under inference mode (else no_grad)"},
        {"detect_anomaly", T::boolean, "false", "Enable autograd anomaly detection"},
        {"sync_batchnorm", T::boolean, "false",
         "fulgur::nn::BatchNorm layers normalize with the statistics of every data-parallel rank's batch "
         "(torch::nn::BatchNorm layers are refused: declare them as fulgur::nn::BatchNorm)"},
        {"return_predictions", T::boolean, "true",
         "predict returns every batch's output, moved to the CPU (false: collect nothing, for runs that only write "
         "predictions through a callback such as prediction_writer)"},
        {"logger", T::boolean, "true",
         "false: no logger at all, [[loggers]] entries included (Lightning's logger=False); true: the "
         "[[loggers]] entries, or the default logger when there are none"},
        {"barebones", T::boolean, "false", "Disable every feature that costs time: loggers, callbacks, profiler"},
        {"ckpt_path", T::string, "\"\"", "Checkpoint to resume fit from: a path, \"last\" or \"best\""},
        {"async_checkpoint", T::boolean, "false",
         "Write checkpoints in a background thread (Lightning's AsyncCheckpointIO): the state is copied to host "
         "memory at the save point and training goes on; one save in flight at most, awaited at the next save and "
         "at the end of fit; a failed save fails the run. Several processes (ddp, fsdp) write their parts in the "
         "background too; a strategy without fulgur.strategy.async_save/1 saves synchronously, with a warning"},
        {"strict_loading", T::boolean, "true",
         "Loading a checkpoint's weights: refuse missing or unexpected keys (false: load those that match, "
         "warn about the rest)"},
        {"init_weights", T::string, "\"\"",
         "Weights the model starts from (fine-tuning): a Fulgur or Lightning checkpoint, a torch.save state dict "
         "or a safetensors file (relative to the TOML file); loaded after configure_model in every stage, but a "
         "checkpoint being resumed or given as ckpt_path wins (\"\": none)"},
        {"init_weights_strip_prefix", T::string, "\"\"",
         "init_weights: removed from the front of the file's keys that carry it (\"model.\" for a LightningModule "
         "that holds the network as self.model)"},
        {"init_weights_add_prefix", T::string, "\"\"",
         "init_weights: put in front of every key of the file (after strip_prefix)"},
        {"init_weights_strict", T::boolean, "true",
         "init_weights: refuse missing or unexpected keys (false: load the keys that match, log the rest); shapes "
         "must match either way"},
        {"interrupt_checkpoint", T::string, "\"interrupted.ckpt\"",
         "Checkpoint written when SIGTERM/SIGINT stop fit (relative to default_root_dir; \"\": default signal action)"},
        {"requeue_signal", T::string, "\"SIGUSR1\"",
         "Under SLURM: this signal checkpoints and runs scontrol requeue (\"\": no auto-requeue)"},
    };
    std::vector<OptionSchema> out;
    for (const Row& r : rows) {
      OptionSchema s;
      s.key = r.key;
      s.type = r.type;
      s.default_text = r.default_text;
      s.default_value = parse_option_default(r.type, r.default_text);
      s.help = r.help;
      out.push_back(std::move(s));
    }
    return out;
  }();
  return schema;
}

namespace {

constexpr std::string_view kKnownTables[] = {"plugins",  "trainer", "accelerator", "strategy", "precision",
                                             "profiler", "loggers", "callbacks",   "model",    "data",
                                             "logging",  "links",   "storage"};

SourceLocation location_of(const toml::node& node, const std::string& fallback_file) {
  SourceLocation loc;
  const toml::source_region& src = node.source();
  loc.file = src.path ? *src.path : fallback_file;
  loc.line = src.begin.line;
  loc.column = src.begin.column;
  return loc;
}

[[noreturn]] void fail(const SourceLocation& where, const std::string& message) {
  throw Error(ErrorKind::config, fmt::format("{}: {}", where.str(), message));
}

std::vector<std::string> keys_of(const std::vector<OptionSchema>& schema) {
  std::vector<std::string> keys;
  for (const auto& s : schema) keys.push_back(s.key);
  return keys;
}

// Ends `message` as a sentence before another one is appended ("unknown key 'x' for [trainer].
// Known keys: ..."), unless it already ends with one ("did you mean 'y'?").
std::string& end_sentence(std::string& message) {
  if (!message.empty() && std::string_view(".?!:").find(message.back()) == std::string_view::npos) message += '.';
  return message;
}

std::string unknown_key_message(std::string_view key, std::string_view owner, const std::vector<std::string>& known) {
  std::string message = fmt::format("unknown key '{}' for {}", key, owner);
  if (std::string s = closest_match(key, known); !s.empty()) message += fmt::format("; did you mean '{}'?", s);
  if (!known.empty())
    end_sentence(message) += fmt::format(" Known keys: {}.", fmt::join(known, ", "));
  else
    end_sentence(message) += " It accepts no options.";
  return message;
}

// Checks a table's keys against a schema and returns typed options with defaults applied.
// `skip` names keys handled elsewhere (e.g. "name").
namespace {

// A TOML value as the option value of its own type (bool, integer, float, string), or nullopt for
// arrays and tables: what lightning_spelling looks at.
std::optional<OptionValue> natural_value(const toml::node& node) {
  if (node.is_boolean()) return OptionValue{*node.value<bool>()};
  if (node.is_integer()) return OptionValue{*node.value<int64_t>()};
  if (node.is_floating_point()) return OptionValue{*node.value<double>()};
  if (node.is_string()) return OptionValue{*node.value<std::string>()};
  return std::nullopt;
}

}  // namespace

}  // namespace

std::string canonical_precision(std::string_view name) {
  // Lightning's short precision spellings, as the build's plugins declare them (ALIASES in
  // plugins/CMakeLists.txt): the core names no plugin.
  for (const builtin::Alias& a : builtin::kAliases)
    if (a.kind == "precision" && a.alias == name) return std::string(a.name);
  return std::string(name);
}

std::optional<OptionValue> lightning_spelling(std::string_view key, const OptionValue& value) {
  if (const bool* flag = std::get_if<bool>(&value)) {
    if (key == "fast_dev_run") return OptionValue{int64_t{*flag ? 1 : 0}};
    if (key == "deterministic") return OptionValue{std::string(*flag ? "true" : "false")};
  }
  if (const int64_t* number = std::get_if<int64_t>(&value))
    if (key == "precision") return OptionValue{std::to_string(*number)};
  if (const std::string* text = std::get_if<std::string>(&value)) {
    if (key == "check_val_every_n_epoch" && (*text == "none" || *text == "None")) return OptionValue{int64_t{0}};
    if (key == "val_check_interval") return value;  // checked as "DD:HH:MM:SS" with the other values
  }
  return std::nullopt;
}

int64_t default_max_epochs(int64_t max_steps) { return max_steps >= 0 ? -1 : 1000; }

OptionValue canonical_trainer_value(std::string_view key, OptionValue value) {
  if (key == "precision")
    if (const auto* name = std::get_if<std::string>(&value)) return OptionValue{canonical_precision(*name)};
  return value;
}

namespace {

fs::path base_of(const SourceLocation& where);

// A path option's value: absolute, lexically normal; "" stays "" (not set).
std::string absolute_path(const std::string& text, const fs::path& base) {
  if (text.empty() || is_storage_url(text)) return text;  // s3://bucket/key (fulgur/storage.h)
  const fs::path p(text);
  return fs::absolute(p.is_absolute() ? p : base / p).lexically_normal().string();
}

// `links`: the [links] entries whose keys this table's values come from later (apply_links): not
// given here, neither required nor defaulted now.
Options typed_options(const std::vector<RawOption>& raw, const std::vector<OptionSchema>& schema,
                      const std::string& owner, const SourceLocation& table_where,
                      const std::vector<ConfigLink>& links = {}) {
  Options options(owner);
  auto link_of = [&](std::string_view key) -> const ConfigLink* {
    for (const ConfigLink& l : links)
      if (l.target == key) return &l;
    return nullptr;
  };
  for (const RawOption& r : raw) {
    const OptionSchema* spec = nullptr;
    for (const auto& s : schema)
      if (s.key == r.key) spec = &s;
    if (!spec) fail(r.where, unknown_key_message(r.key, owner, keys_of(schema)));
    if (const ConfigLink* l = link_of(r.key))
      fail(r.where, fmt::format("{}: '{}' is also linked from {} at {}; give it in one place", owner, r.key, l->source,
                                l->where.str()));
    const auto& node = *static_cast<const toml::node*>(r.node.get());
    std::string found;
    std::optional<OptionValue> value = toml_to_option(node, spec->type, found);
    // `devices = 2` is as natural as `devices = "0,1"`: accept integers for string options that
    // document a count.
    if (!value && spec->type == OptionType::string && node.is_integer() && r.key == "devices")
      value = OptionValue{std::to_string(*node.value<int64_t>())};
    // ... and `devices = [0, 2]` (indices) as "0,2"; "[0]" keeps the brackets so one index is not
    // read as a count.
    if (!value && spec->type == OptionType::string && r.key == "devices" && node.is_array()) {
      const auto& array = *node.as_array();
      std::string joined;
      bool integers = !array.empty();
      for (const auto& item : array) {
        if (!item.is_integer()) integers = false;
        if (!integers) break;
        joined += (joined.empty() ? "" : ",") + std::to_string(*item.value<int64_t>());
      }
      if (integers) value = OptionValue{array.size() == 1 ? "[" + joined + "]" : joined};
    }
    if (!value && owner == "[trainer]")
      if (std::optional<OptionValue> natural = natural_value(node)) value = lightning_spelling(r.key, *natural);
    if (!value)
      fail(r.where, fmt::format("{}: '{}' must be {}, found {}{}", owner, r.key, to_string(spec->type), found,
                                spec->default_value ? fmt::format(" (default: {})", spec->default_text) : ""));
    // Float options given as integers keep their integer-ness: limit_*_batches = 10 is a count.
    if (spec->type == OptionType::floating && node.is_integer()) value = OptionValue{*node.value<int64_t>()};
    if (owner == "[trainer]") value = canonical_trainer_value(r.key, std::move(*value));
    if (spec->type == OptionType::path) value = absolute_path(std::get<std::string>(*value), base_of(r.where));
    options.set(r.key, std::move(*value));
  }
  for (const auto& s : schema) {
    if (options.contains(s.key) || link_of(s.key)) continue;
    if (!s.default_value)
      fail(table_where,
           fmt::format("{}: required key '{}' ({}) is missing: {}", owner, s.key, to_string(s.type), s.help));
    // A relative default path is relative to the file whose table selected the plugin.
    if (s.type == OptionType::path)
      options.set(s.key, absolute_path(std::get<std::string>(*s.default_value), base_of(table_where)));
    else
      options.set(s.key, *s.default_value);
  }
  return options;
}

// Options set in code (ConfigBuilder): the same checks as a TOML table, without locations.
Options typed_given_options(const Options& given, const std::vector<OptionSchema>& schema, const std::string& owner) {
  Options options(owner);
  for (const auto& [key, value] : given.values()) {
    const OptionSchema* spec = nullptr;
    for (const auto& s : schema)
      if (s.key == key) spec = &s;
    if (!spec) throw Error(ErrorKind::config, unknown_key_message(key, owner, keys_of(schema)));
    const bool ok = std::visit(
        [&](const auto& v) {
          using V = std::decay_t<decltype(v)>;
          switch (spec->type) {
            case OptionType::boolean:
              return std::is_same_v<V, bool>;
            case OptionType::integer:
              return std::is_same_v<V, int64_t>;
            case OptionType::floating:
              return std::is_same_v<V, double> || std::is_same_v<V, int64_t>;
            case OptionType::string:
            case OptionType::path:
              return std::is_same_v<V, std::string>;
            case OptionType::string_list:
              return std::is_same_v<V, std::vector<std::string>>;
            case OptionType::float_list:
              return std::is_same_v<V, std::vector<double>>;
          }
          return false;
        },
        value);
    if (!ok)
      throw Error(ErrorKind::config, fmt::format("{}: '{}' must be {}, got {}", owner, key, to_string(spec->type),
                                                 format_option_value(value)));
    // Paths set in code are relative to the working directory, as a flag's.
    if (spec->type == OptionType::path)
      options.set(key, absolute_path(std::get<std::string>(value), fs::current_path()));
    else
      options.set(key, value);
  }
  for (const auto& s : schema) {
    if (options.contains(s.key)) continue;
    if (!s.default_value)
      throw Error(ErrorKind::config,
                  fmt::format("{}: required key '{}' ({}) is missing: {}", owner, s.key, to_string(s.type), s.help));
    if (s.type == OptionType::path)
      options.set(s.key, absolute_path(std::get<std::string>(*s.default_value), fs::current_path()));
    else
      options.set(s.key, *s.default_value);
  }
  return options;
}

std::vector<RawOption> raw_options(const std::shared_ptr<toml::table>& root, const toml::table& table,
                                   const std::string& file, std::initializer_list<std::string_view> skip = {}) {
  std::vector<RawOption> out;
  for (const auto& [key, node] : table) {
    bool skipped = false;
    for (auto s : skip) skipped |= key.str() == s;
    if (skipped) continue;
    RawOption r;
    r.key = std::string(key.str());
    r.where = location_of(node, file);
    if (r.where.line == 0) {
      r.where.line = key.source().begin.line;
      r.where.column = key.source().begin.column;
    }
    r.node = std::shared_ptr<const void>(root, &node);
    out.push_back(std::move(r));
  }
  return out;
}

// Free-form hyperparameter tables ([model], [data]): scalars and flat arrays.
Options free_options(const toml::table& table, const std::string& owner, const std::string& file) {
  Options options(owner);
  for (const auto& [key, node] : table) {
    std::string found;
    std::optional<OptionValue> v;
    if (node.is_boolean())
      v = toml_to_option(node, OptionType::boolean, found);
    else if (node.is_integer())
      v = toml_to_option(node, OptionType::integer, found);
    else if (node.is_floating_point())
      v = toml_to_option(node, OptionType::floating, found);
    else if (node.is_string())
      v = toml_to_option(node, OptionType::string, found);
    else if (node.is_array()) {
      v = toml_to_option(node, OptionType::float_list, found);
      if (!v) v = toml_to_option(node, OptionType::string_list, found);
    }
    if (!v)
      fail(location_of(node, file),
           fmt::format("{}: '{}' is a {}; hyperparameters must be booleans, numbers, strings or flat arrays", owner,
                       key.str(), toml_type_name(node)));
    options.set(std::string(key.str()), std::move(*v));
  }
  return options;
}

const toml::table* table_or_fail(const toml::node& node, std::string_view name, const std::string& file) {
  const toml::table* t = node.as_table();
  if (!t)
    fail(location_of(node, file),
         fmt::format("'{}' must be a table ([{}]), found {}", name, name, toml_type_name(node)));
  return t;
}

std::string string_or_fail(const toml::node& node, std::string_view what, const std::string& file) {
  auto v = node.value_exact<std::string>();
  if (!v) fail(location_of(node, file), fmt::format("{} must be a string, found {}", what, toml_type_name(node)));
  return *v;
}

}  // namespace

namespace {

// Relative paths in a config are relative to the file that gave them (a flag's: the working
// directory), so a layered config can mix files from different directories.
fs::path base_of(const SourceLocation& where) {
  if (where.file.empty() || where.file.starts_with("--")) return fs::current_path();
  const fs::path file(where.file);
  return file.has_parent_path() ? file.parent_path() : fs::current_path();
}

Config config_from_root(std::shared_ptr<toml::table> root, const fs::path& origin) {
  const std::string file = origin.string();
  Config config;
  config.file = origin;
  const fs::path base = origin.has_parent_path() ? origin.parent_path() : fs::current_path();

  for (const auto& [key, node] : *root) {
    bool known = false;
    for (auto k : kKnownTables) known |= key.str() == k;
    if (!known) {
      SourceLocation where = location_of(node, file);
      std::vector<std::string> names(std::begin(kKnownTables), std::end(kKnownTables));
      std::string message = fmt::format("unknown table '{}'", key.str());
      if (auto s = closest_match(key.str(), names); !s.empty()) message += fmt::format("; did you mean '{}'?", s);
      fail(where, end_sentence(message) + fmt::format(" Known tables: {}.", fmt::join(names, ", ")));
    }
  }

  // [plugins]
  if (const toml::node* node = root->get("plugins")) {
    const toml::table* t = table_or_fail(*node, "plugins", file);
    for (const auto& [key, value] : *t) {
      if (key.str() == "paths") {
        const toml::array* paths = value.as_array();
        if (!paths) fail(location_of(value, file), "[plugins] paths must be an array of directory strings");
        for (const auto& p : *paths) {
          fs::path dir = string_or_fail(p, "[plugins] paths entries", file);
          config.plugin_paths.push_back(dir.is_absolute() ? dir : base_of(location_of(p, file)) / dir);
        }
      } else if (key.str() == "allow_writable") {
        auto v = value.value_exact<bool>();
        if (!v) fail(location_of(value, file), "[plugins] allow_writable must be a boolean");
        config.allow_writable_plugins = *v;
      } else {
        fail(location_of(value, file), unknown_key_message(key.str(), "[plugins]", {"paths", "allow_writable"}));
      }
    }
  }

  // [trainer]
  {
    std::vector<RawOption> raw;
    SourceLocation where{file, 0, 0};
    if (const toml::node* node = root->get("trainer")) {
      raw = raw_options(root, *table_or_fail(*node, "trainer", file), file);
      where = location_of(*node, file);
      for (const RawOption& r : raw) config.trainer_locations[r.key] = r.where;
    }
    config.trainer = typed_options(raw, trainer_option_schema(), "[trainer]", where);
    // Lightning's max_epochs = None: 1000 epochs, or no epoch limit when max_steps is given. The
    // resolved value is what the config holds (and to_toml writes), so a saved config reruns alike.
    if (!config.trainer_locations.contains("max_epochs"))
      config.trainer.set("max_epochs", default_max_epochs(config.trainer.get_int("max_steps")));
    fs::path root_dir = config.trainer.get_string("default_root_dir");
    const auto given = config.trainer_locations.find("default_root_dir");
    const fs::path root_base = given == config.trainer_locations.end() ? base : base_of(given->second);
    // A URL root stays as given (checkpoints and logs go there); the files that must stay local
    // (staged logs, traces, finder results) go to staging_dir, which only such a root takes.
    const auto staging = config.trainer_locations.find("staging_dir");
    if (is_storage_url(root_dir.string())) {
      const fs::path staging_dir = config.trainer.get_string("staging_dir");
      const fs::path staging_base = staging == config.trainer_locations.end() ? base : base_of(staging->second);
      if (staging_dir.empty())
        throw Error(ErrorKind::config, fmt::format("{}: [trainer] staging_dir = \"\": give the local directory for "
                                                   "the files that stay on this machine (default \".\")",
                                                   staging->second.str()));
      if (!staging_dir.is_absolute())
        config.trainer.set("staging_dir", (staging_base / staging_dir).lexically_normal().string());
    } else {
      if (staging != config.trainer_locations.end())
        throw Error(ErrorKind::config,
                    fmt::format("{}: [trainer] staging_dir applies only when default_root_dir is a URL "
                                "(s3://bucket/prefix); default_root_dir = \"{}\" is local, so remove staging_dir",
                                staging->second.str(), root_dir.string()));
      if (!root_dir.is_absolute())
        config.trainer.set("default_root_dir", (root_base / root_dir).lexically_normal().string());
    }
    // init_weights and a ckpt_path file like default_root_dir: relative to the file (or flag) that
    // gave them, absolute in the config a run saves (which then resumes from any directory).
    for (const char* key : {"init_weights", "ckpt_path"}) {
      const fs::path path = config.trainer.get_string(key);
      if (path.empty() || path.is_absolute() || path == "last" || path == "best" || is_storage_url(path.string()))
        continue;
      const auto at = config.trainer_locations.find(key);
      const fs::path path_base = at == config.trainer_locations.end() ? base : base_of(at->second);
      config.trainer.set(key, (path_base / path).lexically_normal().string());
    }
  }

  // The three single selections: name in [trainer], options in their own table (which may also
  // carry `name`, as long as both agree).
  auto single = [&](PluginSelection& sel, PluginKind kind, const char* table_name) {
    sel.kind = kind;
    sel.name = config.trainer.get_string(table_name);
    sel.where = {file, 0, 0};
    for (const auto& [key, node] : *root)
      if (key.str() == "trainer")
        if (const toml::node* n = node.as_table()->get(table_name)) sel.where = location_of(*n, file);
    if (const toml::node* node = root->get(table_name)) {
      const toml::table* t = table_or_fail(*node, table_name, file);
      if (const toml::node* n = t->get("name")) {
        std::string name = string_or_fail(*n, fmt::format("[{}] name", table_name), file);
        if (kind == PluginKind::precision) name = canonical_precision(name);
        if (sel.where.line > 0 && name != sel.name)
          fail(location_of(*n, file), fmt::format("[{}] name = \"{}\" contradicts [trainer] {} = \"{}\" at {}",
                                                  table_name, name, table_name, sel.name, sel.where.str()));
        sel.name = name;
        sel.where = location_of(*n, file);
      }
      sel.raw = raw_options(root, *t, file, {"name"});
    }
  };
  single(config.accelerator, PluginKind::accelerator, "accelerator");
  single(config.strategy, PluginKind::strategy, "strategy");
  single(config.precision, PluginKind::precision, "precision");

  auto named_table = [&](const toml::table& t, const toml::node& at, PluginKind kind, std::string_view what) {
    PluginSelection sel;
    sel.kind = kind;
    const toml::node* n = t.get("name");
    if (!n) fail(location_of(at, file), fmt::format("{} needs a name = \"...\" selecting the plugin", what));
    sel.name = string_or_fail(*n, fmt::format("{} name", what), file);
    sel.where = location_of(*n, file);
    sel.raw = raw_options(root, t, file, {"name"});
    return sel;
  };
  if (const toml::node* node = root->get("profiler"))
    config.profiler = named_table(*table_or_fail(*node, "profiler", file), *node, PluginKind::profiler, "[profiler]");
  if (const toml::node* node = root->get("storage"))
    config.storage = named_table(*table_or_fail(*node, "storage", file), *node, PluginKind::storage, "[storage]");
  // [[loggers]]: `logger` selects the plugin, so `name` is free for the logger's own option (the
  // csv / tensorboard experiment name, Lightning's CSVLogger(name=...)). A table without `logger`
  // is the old spelling, where `name` selected the plugin; it keeps working.
  auto logger_table = [&](const toml::table& t, const toml::node& at) {
    const toml::node* selector = t.get("logger");
    if (!selector && !t.get("name"))
      fail(location_of(at, file),
           "[[loggers]] needs logger = \"...\" selecting the plugin (`fulgur plugins list` shows the loggers)");
    if (!selector) {
      PluginSelection sel = named_table(t, at, PluginKind::logger, "[[loggers]]");
      spdlog::info(
          "{}: [[loggers]] name = \"{}\" selects the logger (the old spelling); write logger = \"{}\", "
          "then name = \"...\" sets the logger's own name option",
          sel.where.str(), sel.name, sel.name);
      return sel;
    }
    PluginSelection sel;
    sel.kind = PluginKind::logger;
    sel.name = string_or_fail(*selector, "[[loggers]] logger", file);
    sel.where = location_of(*selector, file);
    sel.selector = "logger";
    sel.raw = raw_options(root, t, file, {"logger"});
    return sel;
  };
  auto array_of_tables = [&](const char* name, PluginKind kind, std::vector<PluginSelection>& out) {
    const toml::node* node = root->get(name);
    if (!node) return;
    const toml::array* array = node->as_array();
    if (!array)
      fail(location_of(*node, file),
           fmt::format("'{}' must be an array of tables ([[{}]]), found {}", name, name, toml_type_name(*node)));
    for (const toml::node& element : *array) {
      const toml::table* t = element.as_table();
      if (!t) fail(location_of(element, file), fmt::format("each [[{}]] entry must be a table", name));
      out.push_back(kind == PluginKind::logger ? logger_table(*t, element)
                                               : named_table(*t, element, kind, fmt::format("[[{}]]", name)));
    }
  };
  array_of_tables("loggers", PluginKind::logger, config.loggers);
  if (const toml::node* node = root->get("loggers")) config.no_loggers = node->as_array()->empty();
  array_of_tables("callbacks", PluginKind::callback, config.callbacks);

  // [model] / [data]: with a name, a plugin and its hyperparameters (checked against its schema by
  // validate_plugins); without, free-form values for a program's own classes.
  auto user_table = [&](const char* name, PluginKind kind, PluginSelection& sel, Options& free) {
    sel.kind = kind;
    const toml::node* node = root->get(name);
    if (!node) return;
    const toml::table* t = table_or_fail(*node, name, file);
    sel.where = location_of(*node, file);
    sel.raw = raw_options(root, *t, file, {"name"});
    if (const toml::node* n = t->get("name")) {
      sel.name = string_or_fail(*n, fmt::format("[{}] name", name), file);
      sel.where = location_of(*n, file);
    } else {
      free = free_options(*t, fmt::format("[{}]", name), file);
    }
  };
  user_table("model", PluginKind::model, config.model_plugin, config.model);
  user_table("data", PluginKind::datamodule, config.data_plugin, config.data);
  // [links]: model.KEY = "data.NAME" (dotted keys nest in TOML: a [links] table holding a `model`
  // table; "model.KEY" quoted is one key, as to_toml writes it).
  if (const toml::node* node = root->get("links")) {
    const toml::table* t = table_or_fail(*node, "links", file);
    auto add = [&](const std::string& target, const toml::node& value) {
      const SourceLocation where = location_of(value, file);
      const std::string text = fmt::format("[links] {}", target);
      if (!target.starts_with("model.") || target.size() == 6)
        fail(where, fmt::format("{}: a link sets a [model] key: model.KEY = \"data.NAME\"", text));
      const std::string source = string_or_fail(value, text, file);
      if (!source.starts_with("data.") || source.size() == 5)
        fail(where, fmt::format("{} = \"{}\": the value comes from the datamodule: \"data.NAME\"", text, source));
      for (const ConfigLink& l : config.links)
        if (l.target == target.substr(6))
          fail(where, fmt::format("{} is linked twice (also at {})", text, l.where.str()));
      config.links.push_back({target.substr(6), source.substr(5), where});
    };
    for (const auto& [key, value] : *t) {
      if (const toml::table* inner = value.as_table())
        for (const auto& [k, v] : *inner) add(fmt::format("{}.{}", key.str(), k.str()), v);
      else
        add(std::string(key.str()), value);
    }
  }
  if (const toml::node* node = root->get("logging")) {
    const toml::table* t = table_or_fail(*node, "logging", file);
    for (const auto& [key, value] : *t) {
      if (key.str() != "level") fail(location_of(value, file), unknown_key_message(key.str(), "[logging]", {"level"}));
      config.log_level = string_or_fail(value, "[logging] level", file);
    }
  }
  if (const char* env = std::getenv("FULGUR_LOG_LEVEL"); env && *env) config.log_level = env;
  return config;
}

toml::table parse_toml(std::string_view toml_text, const std::string& file) {
  try {
    return toml::parse(toml_text, std::string(file));
  } catch (const toml::parse_error& e) {
    SourceLocation where{file, e.source().begin.line, e.source().begin.column};
    fail(where, fmt::format("invalid TOML: {}", e.description()));
  }
}

std::string read_config_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw Error(ErrorKind::config, fmt::format("{}: cannot open the config file ({}); check the path", file.string(),
                                               std::strerror(errno)));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Later files win key by key; tables merge, every other value (arrays of tables included) is
// replaced whole. Nodes are moved, not copied: a move keeps the source region, so errors still
// point into the file that gave the value.
void merge_into(toml::table& into, toml::table&& from) {
  for (auto&& [key, node] : from) {
    if (toml::table* incoming = node.as_table()) {
      if (toml::node* existing = into.get(key.str()); existing && existing->is_table()) {
        merge_into(*existing->as_table(), std::move(*incoming));
        continue;
      }
    }
    into.insert_or_assign(key, std::move(node));
  }
}

// A TOML basic string: quotes, backslashes and control characters escaped.
std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20)
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    else
      out += c;
  }
  return out + "\"";
}

const std::vector<std::string> kListTables = {"callbacks", "loggers"};

// One `section.key=value` override. The value is TOML when it parses as TOML (3, 3e-4, true,
// [1, 2], "x"), else a string (cpu, val/acc, 0,1): what a shell user types without quotes.
void apply_override(toml::table& root, const std::string& text) {
  const std::string flag = "--" + text;
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw Error(ErrorKind::config, fmt::format("{}: an override needs the form --section.key=value", flag));
  const std::string path = text.substr(0, eq);
  const std::string value_text = text.substr(eq + 1);
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (const auto& p : parts)
    if (p.empty()) throw Error(ErrorKind::config, fmt::format("{}: empty name in '{}'", flag, path));
  std::vector<std::string> tables(std::begin(kKnownTables), std::end(kKnownTables));
  if (std::find(tables.begin(), tables.end(), parts[0]) == tables.end()) {
    for (const OptionSchema& o : trainer_option_schema())
      if (o.key == parts[0])
        throw Error(ErrorKind::config, fmt::format("unknown flag {}; did you mean --trainer.{}?", flag, text));
    std::string message = fmt::format("unknown flag {}: no section '{}'", flag, parts[0]);
    if (auto s = closest_match(parts[0], tables); !s.empty()) message += fmt::format("; did you mean '--{}.'?", s);
    throw Error(ErrorKind::config, end_sentence(message) + fmt::format(" Sections: {}.", fmt::join(tables, ", ")));
  }
  const bool list_table = std::find(kListTables.begin(), kListTables.end(), parts[0]) != kListTables.end();
  // --loggers=[] / --callbacks=[]: the whole list, replacing what the files gave (Lightning's
  // --trainer.logger=[] / --trainer.callbacks=[]); an empty [[loggers]] list means no logger.
  if (parts.size() == 1 && list_table) {
    toml::table parsed;
    try {
      parsed = toml::parse("v = " + value_text, std::string(flag));
    } catch (const toml::parse_error&) {
    }
    const toml::array* array = parsed.get("v") ? parsed.get("v")->as_array() : nullptr;
    if (!array)
      throw Error(ErrorKind::config, fmt::format("{}: --{} takes a list: --{}=[] removes every [[{}]] entry, "
                                                 "--{}.NAME.KEY=VALUE sets one entry's option",
                                                 flag, parts[0], parts[0], parts[0], parts[0]));
    root.insert_or_assign(parts[0], std::move(*parsed.get("v")));
    return;
  }
  // --model=NAME / --data=NAME / --profiler=NAME / --storage=NAME select the plugin of that table.
  if (parts.size() == 1) {
    if (parts[0] != "model" && parts[0] != "data" && parts[0] != "profiler" && parts[0] != "storage")
      throw Error(ErrorKind::config, fmt::format("{}: give a key, --{}.KEY=VALUE", flag, parts[0]));
    parts.push_back("name");
  }

  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value_text, std::string(flag));
  } catch (const toml::parse_error&) {
    parsed = toml::parse("v = " + toml_string(value_text), std::string(flag));
  }
  toml::node& value = *parsed.get("v");

  toml::table* table = &root;
  if (list_table) {
    // --callbacks.early_stopping.patience=5: the entry selecting that plugin.
    if (parts.size() != 3)
      throw Error(ErrorKind::config, fmt::format("{}: address a [[{}]] entry by its plugin name: --{}.NAME.KEY=VALUE",
                                                 flag, parts[0], parts[0]));
    std::vector<toml::table*> matches;
    std::vector<std::string> names;
    if (toml::array* entries = root[parts[0]].as_array())
      for (toml::node& entry : *entries)
        if (toml::table* t = entry.as_table()) {
          // [[loggers]]: `logger` selects, or `name` in the old spelling.
          const bool by_logger = parts[0] == "loggers" && t->contains("logger");
          const auto name = (*t)[by_logger ? "logger" : "name"].value<std::string>();
          if (name) names.push_back(*name);
          if (name == parts[1]) matches.push_back(t);
        }
    if (matches.size() != 1) {
      std::string message = matches.empty() ? fmt::format("{}: no [[{}]] entry selects '{}'", flag, parts[0], parts[1])
                                            : fmt::format("{}: {} [[{}]] entries select '{}'; edit the file", flag,
                                                          matches.size(), parts[0], parts[1]);
      if (auto s = closest_match(parts[1], names); !s.empty() && matches.empty())
        message += fmt::format("; did you mean '{}'?", s);
      if (matches.empty())
        end_sentence(message) += names.empty() ? fmt::format(" The config has no [[{}]].", parts[0])
                                               : fmt::format(" Configured: {}.", fmt::join(names, ", "));
      throw Error(ErrorKind::config, message);
    }
    matches[0]->insert_or_assign(parts[2], std::move(value));
    return;
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    toml::node* next = table->get(parts[i]);
    if (!next) next = &table->insert_or_assign(parts[i], toml::table{}).first->second;
    if (!next->is_table())
      throw Error(ErrorKind::config,
                  fmt::format("{}: '{}' is a {}, not a table", flag, parts[i], toml_type_name(*next)));
    table = next->as_table();
  }
  table->insert_or_assign(parts.back(), std::move(value));
}

}  // namespace

Config parse_config(std::string_view toml_text, const fs::path& origin) {
  auto root = std::make_shared<toml::table>(parse_toml(toml_text, origin.string()));
  return config_from_root(std::move(root), origin);
}

Config load_config(const fs::path& file) { return parse_config(read_config_file(file), file); }

Config load_config(const std::vector<fs::path>& files, const std::vector<std::string>& overrides) {
  auto root = std::make_shared<toml::table>();
  for (const fs::path& file : files) merge_into(*root, parse_toml(read_config_file(file), file.string()));
  for (const std::string& text : overrides) apply_override(*root, text);
  Config config = config_from_root(std::move(root), files.empty() ? fs::path() : files.front());
  config.files = files;
  return config;
}

namespace {

// [trainer] accelerator = "auto": the available accelerator of highest priority among those the
// build marked (fulgur/builtin_plugins.h), as Lightning picks cuda when a GPU is visible.
// "gpu" (Lightning's alias for whichever GPU accelerator the machine has) is the same choice
// among the accelerators whose device is not the cpu; the core names no accelerator.
std::string choose_auto_accelerator(const PluginSelection& sel, const PluginRegistry& registry, bool devices_only) {
  const std::string spelled = devices_only ? "gpu" : "auto";
  if (!sel.raw.empty() || !sel.given.values().empty())
    throw Error(ErrorKind::config,
                fmt::format("{}: accelerator = \"{}\" takes no [accelerator] options (each accelerator has its own); "
                            "name the accelerator to set options (`fulgur plugins list` shows them)",
                            sel.where.str(), spelled));
  std::vector<builtin::AutoAccelerator> order(std::begin(builtin::kAutoAccelerators),
                                              std::end(builtin::kAutoAccelerators));
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.priority > b.priority; });
  std::vector<std::string> tried;
  for (const builtin::AutoAccelerator& candidate : order) {
    const std::string name(candidate.name);
    try {
      const PluginCandidate& found = registry.resolve(PluginKind::accelerator, name);
      auto accelerator =
          plugin_cast<Accelerator>(registry.create(PluginKind::accelerator, name, default_options(found.metadata)));
      if (devices_only && accelerator->device_type() == c10::DeviceType::CPU) continue;
      if (accelerator->is_available()) {
        spdlog::info("accelerator = \"{}\": using '{}'", spelled, name);
        return name;
      }
      tried.push_back(fmt::format("{} (no device)", name));
    } catch (const Error& e) {
      // Said now, not only if nothing is found: a GPU the process cannot use must not turn into a
      // silent cpu run.
      spdlog::warn("accelerator = \"{}\": skipping '{}': {}", spelled, name, e.what());
      tried.push_back(fmt::format("{} ({})", name, e.what()));
    }
  }
  throw Error(
      ErrorKind::config,
      fmt::format("{}: accelerator = \"{}\" found no available {}accelerator; tried {}{}", sel.where.str(), spelled,
                  devices_only ? "GPU " : "", tried.empty() ? "none" : fmt::format("{}", fmt::join(tried, "; ")),
                  devices_only ? " (on a machine without a GPU, use accelerator = \"auto\")" : ""));
}

}  // namespace

namespace {

// Each [links] target is a key of the model's schema; its type is what the linked value must be.
void resolve_link_types(std::vector<ConfigLink>& links, const std::vector<OptionSchema>& schema,
                        const std::string& owner) {
  for (ConfigLink& link : links) {
    const OptionSchema* spec = nullptr;
    for (const auto& s : schema)
      if (s.key == link.target) spec = &s;
    if (!spec)
      fail(link.where,
           fmt::format("[links] model.{}: {}", link.target, unknown_key_message(link.target, owner, keys_of(schema))));
    link.type = spec->type;
  }
}

}  // namespace

void validate_plugins(Config& config, const PluginRegistry& registry) {
  if (config.accelerator.name == "auto" || config.accelerator.name == "gpu")
    config.accelerator.name =
        choose_auto_accelerator(config.accelerator, registry, /*devices_only=*/config.accelerator.name == "gpu");
  for (PluginSelection* sel : config.selections()) {
    const PluginCandidate* candidate = nullptr;
    try {
      candidate = &registry.resolve(sel->kind, sel->name);
    } catch (const Error& e) {
      // [[loggers]] name = "exp1" without `logger`: most likely the experiment name; say so first,
      // with the build's default logger (the core names no plugin itself).
      if (sel->kind == PluginKind::logger && sel->selector == "name") {
        std::string example = "...";
        for (const builtin::Default& d : builtin::kDefaults)
          if (d.kind == PluginKind::logger) example = d.name;
        throw Error(e.kind(), fmt::format("{}: [[loggers]] name = \"{}\" selects no logger: logger = \"...\" selects "
                                          "the plugin; if '{}' is the experiment name, write logger = \"{}\" and "
                                          "name = \"{}\". {}",
                                          sel->where.str(), sel->name, sel->name, example, sel->name, e.what()));
      }
      throw Error(e.kind(), fmt::format("{}: {}", sel->where.str(), e.what()));
    }
    const std::string owner = fmt::format("{} '{}'", to_string(sel->kind), sel->name);
    SourceLocation table_where = sel->where;
    const bool model = sel == &config.model_plugin;
    if (model) resolve_link_types(config.links, candidate->metadata.options, owner);
    if (sel->from_code)
      sel->options = typed_given_options(sel->given, candidate->metadata.options, owner);
    else
      sel->options = typed_options(sel->raw, candidate->metadata.options, owner, table_where,
                                   model ? config.links : std::vector<ConfigLink>{});
  }
  // The schema is the single source of truth for hyperparameters: the Module, the loggers and the
  // checkpoint all see the typed, defaulted values.
  if (!config.model_plugin.name.empty()) config.model = config.model_plugin.options;
  if (!config.data_plugin.name.empty()) config.data = config.data_plugin.options;
}

void apply_hparams_schema(Config& config, PluginKind kind, const std::vector<OptionSchema>& schema,
                          const std::string& owner) {
  if (kind != PluginKind::model && kind != PluginKind::datamodule)
    throw Error(ErrorKind::invalid_argument, "apply_hparams_schema: kind must be model or datamodule");
  PluginSelection& sel = kind == PluginKind::model ? config.model_plugin : config.data_plugin;
  const char* table = kind == PluginKind::model ? "[model]" : "[data]";
  if (!sel.name.empty())
    throw Error(ErrorKind::config,
                fmt::format("{}: {} name = \"{}\" selects a plugin, but this program builds its own {}; "
                            "remove the name",
                            sel.where.str(), table, sel.name, to_string(kind)));
  const std::string described = owner.empty() ? std::string(table) : fmt::format("{} ({})", table, owner);
  if (kind == PluginKind::model) resolve_link_types(config.links, schema, described);
  Options typed = typed_options(sel.raw, schema, described,
                                sel.where.file.empty() ? SourceLocation{config.file.string(), 0, 0} : sel.where,
                                kind == PluginKind::model ? config.links : std::vector<ConfigLink>{});
  sel.options = typed;
  (kind == PluginKind::model ? config.model : config.data) = std::move(typed);
}

namespace {

// TOML text of a value that reads back as the same OptionValue: a float always has a '.' or an
// exponent (1.0, not 1, which would read back as an integer, and limit_*_batches = 1 is a count).
std::string toml_text(const OptionValue& value);

std::string toml_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string text = fmt::format("{}", d);  // shortest text that reads back as the same double
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

std::string toml_text(const OptionValue& value) {
  struct Visitor {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return toml_float(d); }
    std::string operator()(const std::string& s) const { return toml_string(s); }
    std::string operator()(const std::vector<std::string>& l) const {
      std::vector<std::string> items;
      for (const auto& s : l) items.push_back(toml_string(s));
      return fmt::format("[{}]", fmt::join(items, ", "));
    }
    std::string operator()(const std::vector<double>& l) const {
      std::vector<std::string> items;
      for (double d : l) items.push_back(toml_float(d));
      return fmt::format("[{}]", fmt::join(items, ", "));
    }
  };
  return std::visit(Visitor{}, value);
}

std::string bare_or_quoted_key(const std::string& key) {
  const bool bare = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
  return bare ? key : toml_string(key);
}

// Where `name` selects the plugin in its table, a plugin option of that name cannot be given in TOML
// and is left out ([[loggers]] select with `logger`, so theirs is written).
void write_options(std::string& out, const Options& options, bool in_plugin_table = true, std::string_view skip = {}) {
  for (const auto& [key, value] : options.values())
    if ((!in_plugin_table || key != "name") && key != skip)
      out += fmt::format("{} = {}\n", bare_or_quoted_key(key), toml_text(value));
}

}  // namespace

std::string to_toml(const Config& config) {
  std::string out;
  if (config.no_loggers && config.loggers.empty()) out += "loggers = []  # no logger\n\n";
  if (!config.plugin_paths.empty() || config.allow_writable_plugins) {
    out += "[plugins]\n";
    std::vector<std::string> paths;
    for (const auto& p : config.plugin_paths) paths.push_back(toml_string(fs::absolute(p).lexically_normal().string()));
    out += fmt::format("paths = [{}]\nallow_writable = {}\n\n", fmt::join(paths, ", "),
                       config.allow_writable_plugins ? "true" : "false");
  }
  // [trainer] with the plugins actually selected (accelerator = "auto" resolved by
  // validate_plugins) and every other key at its value or default.
  Options trainer = config.trainer;
  trainer.set("accelerator", config.accelerator.name);
  trainer.set("strategy", config.strategy.name);
  trainer.set("precision", config.precision.name);
  for (const char* key : {"default_root_dir", "staging_dir"})
    if (!is_storage_url(trainer.get_string(key)))
      trainer.set(key, fs::absolute(trainer.get_string(key)).lexically_normal().string());
  // staging_dir only goes with a URL root (and is refused beside a local one).
  const bool url_root = is_storage_url(trainer.get_string("default_root_dir"));
  out += "[trainer]\n";
  write_options(out, trainer, /*in_plugin_table=*/false, url_root ? "" : "staging_dir");
  auto single = [&](const char* table, const PluginSelection& sel) {
    if (sel.options.values().empty()) return;
    out += fmt::format("\n[{}]\n", table);
    write_options(out, sel.options);
  };
  single("accelerator", config.accelerator);
  single("strategy", config.strategy);
  single("precision", config.precision);
  if (config.profiler) {
    out += fmt::format("\n[profiler]\nname = {}\n", toml_string(config.profiler->name));
    write_options(out, config.profiler->options);
  }
  if (config.storage) {
    out += fmt::format("\n[storage]\nname = {}\n", toml_string(config.storage->name));
    write_options(out, config.storage->options);
  }
  auto user = [&](const char* table, const PluginSelection& sel, const Options& values) {
    if (sel.name.empty() && values.values().empty()) return;
    out += fmt::format("\n[{}]\n", table);
    if (!sel.name.empty()) out += fmt::format("name = {}\n", toml_string(sel.name));
    write_options(out, values);
  };
  // Linked [model] keys stay links: a rerun takes them from its datamodule again.
  Options model = config.model;
  if (!config.links.empty()) {
    model = Options(config.model.owner());
    for (const auto& [key, value] : config.model.values())
      if (std::none_of(config.links.begin(), config.links.end(), [&](const ConfigLink& l) { return l.target == key; }))
        model.set(key, value);
  }
  user("model", config.model_plugin, model);
  user("data", config.data_plugin, config.data);
  if (!config.links.empty()) {
    out += "\n[links]\n";
    for (const ConfigLink& l : config.links)
      out += fmt::format("{} = {}\n", toml_string("model." + l.target), toml_string("data." + l.source));
  }
  auto list = [&](const char* table, const char* selector, const std::vector<PluginSelection>& entries) {
    for (const PluginSelection& sel : entries) {
      out += fmt::format("\n[[{}]]\n{} = {}\n", table, selector, toml_string(sel.name));
      write_options(out, sel.options, /*in_plugin_table=*/std::string_view(selector) == "name");
    }
  };
  list("loggers", "logger", config.loggers);
  list("callbacks", "name", config.callbacks);
  if (!config.log_level.empty()) out += fmt::format("\n[logging]\nlevel = {}\n", toml_string(config.log_level));
  return out;
}

}  // namespace fulgur
