// Which plugins a run uses: the config's selections, resolved and created through the registry,
// plus the default set the build generated (fulgur/builtin_plugins.h). The core knows no plugin
// by name beyond that generated list; everything else it learns from what plugins declare.
#include <fulgur/builtin_plugins.h>
#include <fulgur/data_module.h>
#include <fulgur/error.h>
#include <fulgur/registry/storage_loader.h>
#include <fulgur/storage.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "../resolved_trainer_config.h"
#include "plugin_connector.h"

namespace fulgur {

namespace {

PluginIdentity identity_of(const PluginRegistry& registry, PluginKind kind, const std::string& name) {
  return PluginIdentity{std::string(to_string(kind)), name, registry.resolve(kind, name).file.string()};
}

std::unique_ptr<PluginRegistry> make_registry(const Config& config) {
  SearchPathOptions search;
  search.config_paths = config.plugin_paths;
  RegistryOptions registry_options;
  registry_options.allow_writable = config.allow_writable_plugins;
  auto registry = std::make_unique<PluginRegistry>(plugin_search_path(search), registry_options);
  for (const auto& p : registry->problems())
    if (p.is_plugin_error) spdlog::warn("plugin {}: {}", p.file.string(), p.reason);
  return registry;
}

// Creates a callback and checks its declarations: a plugin that overrides hooks it did not list
// in hooks() would silently never see them.
std::shared_ptr<Callback> create_callback(const PluginRegistry& registry, const std::string& name,
                                          const Options& options) {
  return plugin_cast<Callback>(registry.create(PluginKind::callback, name, options));
}

// The value of the [trainer] key a shorthand stands for; empty: the key is not set.
const std::string& shorthand_value(const Config& config, const builtin::Shorthand& shorthand) {
  return config.trainer.get_string(shorthand.trainer_key);
}

// The callback a non-empty [trainer] key stands for (builtin::kShorthands: Lightning's
// Trainer(max_time=...) adds a Timer(duration=max_time)): its schema's defaults, and its option set
// to the key's value. What the callback refuses is reported against the [trainer] key.
std::shared_ptr<Callback> create_shorthand(const Config& config, const PluginRegistry& registry,
                                           const builtin::Shorthand& shorthand) {
  const std::string name(shorthand.name);
  const std::string& value = shorthand_value(config, shorthand);
  Options options(fmt::format("{} '{}'", to_string(PluginKind::callback), name));
  for (const OptionSchema& spec : registry.resolve(PluginKind::callback, name).metadata.options)
    if (spec.default_value) options.set(spec.key, *spec.default_value);
  options.set(std::string(shorthand.option), value);
  try {
    return create_callback(registry, name, options);
  } catch (const Error& e) {
    const auto where = config.trainer_locations.find(shorthand.trainer_key);
    throw Error(e.kind(), fmt::format("{}[trainer] {} = \"{}\": {}",
                                      where == config.trainer_locations.end() ? "" : where->second.str() + ": ",
                                      shorthand.trainer_key, value, e.what()));
  }
}

}  // namespace

PluginSet connect_plugins(Config& config, bool fast_dev_run) {
  PluginSet set;
  set.registry = make_registry(config);
  const PluginRegistry& registry = *set.registry;
  const bool barebones = config.trainer.get_bool("barebones");
  // Every table is checked against its plugin's schema before any plugin code runs.
  validate_plugins(config, registry);

  // Object storage: the first URL of a scheme creates the storage plugin of that name from the same
  // search path (the scheme comes from the user's URL, so the core names no storage). The one that
  // [storage] configures is created now, so that a bad value fails before any training.
  std::optional<ConfiguredStorage> storage;
  if (config.storage) storage = ConfiguredStorage{config.storage->name, config.storage->options};
  try {
    install_storage_loader(registry.search_path(), config.allow_writable_plugins, storage);
  } catch (const Error& e) {
    if (!config.storage) throw;
    throw Error(e.kind(),
                fmt::format("{}: storage '{}': {}", config.storage->where.str(), config.storage->name, e.what()));
  }

  set.accelerator = plugin_cast<Accelerator>(
      registry.create(PluginKind::accelerator, config.accelerator.name, config.accelerator.options));
  if (!set.accelerator->is_available()) {
    // An accelerator that offers no device says why when asked for one (Accelerator::parse_devices
    // throws naming what is missing): that line is the refusal, before any file is written.
    try {
      (void)set.accelerator->parse_devices(config.trainer.get_string("devices"));
    } catch (const Error& e) {
      throw Error(ErrorKind::config, fmt::format("{}: {}", config.accelerator.where.str(), e.what()));
    }
    throw Error(ErrorKind::config, fmt::format("{}: accelerator '{}' is not available on this machine",
                                               config.accelerator.where.str(), config.accelerator.name));
  }
  set.strategy =
      plugin_cast<Strategy>(registry.create(PluginKind::strategy, config.strategy.name, config.strategy.options));
  set.precision =
      plugin_cast<Precision>(registry.create(PluginKind::precision, config.precision.name, config.precision.options));
  set.step_graphs = find_extension<StepGraphFactory>(*set.accelerator);
  set.staged_transfers = find_extension<StagedTransfers>(*set.accelerator);
  set.strategy_device_step = find_extension<DeviceStepStrategy>(*set.strategy);
  set.precision_device_step = find_extension<DeviceStepPrecision>(*set.precision);
  if (config.profiler && !barebones)
    set.profiler =
        plugin_cast<Profiler>(registry.create(PluginKind::profiler, config.profiler->name, config.profiler->options));

  auto is_default_enabled = [&](const builtin::Default& d) {
    return config.trainer.get_bool(d.enabled_by) && (d.in_fast_dev_run || !fast_dev_run);
  };
  // [trainer] logger = false: no logger at all, as Lightning's logger=False; the [[loggers]]
  // entries stay in the config (a layered file or --trainer.logger=true turns them back on).
  const bool logging_on = config.trainer.get_bool("logger");
  if (!logging_on && !config.loggers.empty())
    spdlog::info("[trainer] logger = false: the {} [[loggers]] entr{} write nothing", config.loggers.size(),
                 config.loggers.size() == 1 ? "y" : "ies");
  if (!barebones && !fast_dev_run && logging_on) {
    for (const auto& sel : config.loggers) {
      set.loggers.push_back(plugin_cast<Logger>(registry.create(PluginKind::logger, sel.name, sel.options)));
      set.logger_identities.push_back(identity_of(registry, PluginKind::logger, sel.name));
    }
  }
  if (!barebones && config.loggers.empty() && !config.no_loggers) {
    for (const builtin::Default& d : builtin::kDefaults) {
      if (d.kind != PluginKind::logger || !is_default_enabled(d)) continue;
      const std::string name(d.name);
      const Options defaults = default_options(registry.resolve(PluginKind::logger, name).metadata);
      set.loggers.push_back(plugin_cast<Logger>(registry.create(PluginKind::logger, name, defaults)));
      set.logger_identities.push_back(identity_of(registry, PluginKind::logger, name));
    }
  }
  const auto configured = [&](std::string_view name) {
    return !barebones && std::any_of(config.callbacks.begin(), config.callbacks.end(),
                                     [&](const PluginSelection& sel) { return sel.name == name; });
  };
  if (!barebones) {
    for (const auto& sel : config.callbacks) {
      auto callback = create_callback(registry, sel.name, sel.options);
      // fast_dev_run: no checkpoints, no decisions from monitored metrics (Lightning).
      if (fast_dev_run && (callback->roles() & (CallbackRole::monitor | CallbackRole::checkpoint))) continue;
      set.callbacks.push_back({std::move(callback), identity_of(registry, PluginKind::callback, sel.name)});
    }
  }
  // [trainer] keys that stand for a callback, in barebones runs too (Lightning keeps max_time's
  // Timer there). A callback the config selects itself wins, as in Lightning.
  for (const builtin::Shorthand& shorthand : builtin::kShorthands) {
    if (shorthand_value(config, shorthand).empty()) continue;
    const std::string name(shorthand.name);
    if (configured(name)) {
      spdlog::info("Ignoring [trainer] {}: the config already selects callback '{}'", shorthand.trainer_key, name);
      continue;
    }
    set.callbacks.push_back(
        {create_shorthand(config, registry, shorthand), identity_of(registry, PluginKind::callback, name)});
  }
  if (barebones) return set;

  for (const builtin::Default& d : builtin::kDefaults) {
    if (d.kind != PluginKind::callback || !is_default_enabled(d)) continue;
    const std::string name(d.name);
    if (configured(name)) continue;
    const Options defaults = default_options(registry.resolve(PluginKind::callback, name).metadata);
    auto callback = create_callback(registry, name, defaults);
    // A configured checkpoint callback (any plugin with that role) replaces the default one, as a
    // ModelCheckpoint in Lightning's callbacks list does.
    if (has_role(callback->roles(), CallbackRole::checkpoint)) {
      bool has_checkpointing = false;
      for (const auto& slot : set.callbacks)
        has_checkpointing |= has_role(slot.callback->roles(), CallbackRole::checkpoint);
      if (has_checkpointing) continue;
    }
    set.callbacks.push_back({std::move(callback), identity_of(registry, PluginKind::callback, name)});
  }
  return set;
}

void check_config_values(Config& config, const PluginRegistry& registry) {
  validate_plugins(config, registry);
  validate_trainer_values(config);
  // The plugins' own value checks live in their constructors: build each one and let it go. With
  // [links], the model is built last, with the values of the datamodule built before it.
  const bool linked = !config.links.empty() && !config.model_plugin.name.empty();
  for (PluginSelection* sel : config.selections()) {
    if (linked && sel == &config.model_plugin) continue;
    try {
      PluginObject object = registry.create(sel->kind, sel->name, sel->options);
      if (linked && sel == &config.data_plugin) apply_links(config, *static_cast<DataModule*>(object.get()));
    } catch (const Error& e) {
      throw Error(e.kind(), fmt::format("{}: {}", sel->where.str(), e.what()));
    }
  }
  if (linked) {
    try {
      registry.create(PluginKind::model, config.model_plugin.name, config.model_plugin.options);
    } catch (const Error& e) {
      throw Error(e.kind(), fmt::format("{}: {}", config.model_plugin.where.str(), e.what()));
    }
  }
  for (const builtin::Shorthand& shorthand : builtin::kShorthands)
    if (!shorthand_value(config, shorthand).empty()) (void)create_shorthand(config, registry, shorthand);
}

}  // namespace fulgur
