// Which plugins a run uses: the config's selections, resolved and created through the registry,
// plus the default set the build generated (fulgur/builtin_plugins.h). The core knows no plugin
// by name beyond that generated list; everything else it learns from what plugins declare.
#include <fulgur/builtin_plugins.h>
#include <fulgur/error.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "../trainer_impl.h"

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

}  // namespace

PluginSet connect_plugins(Config& config, bool fast_dev_run) {
  PluginSet set;
  set.registry = make_registry(config);
  const PluginRegistry& registry = *set.registry;
  const bool barebones = config.trainer.get_bool("barebones");
  // Every table is checked against its plugin's schema before any plugin code runs.
  validate_plugins(config, registry);

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
  if (!barebones && !fast_dev_run) {
    for (const auto& sel : config.loggers) {
      set.loggers.push_back(plugin_cast<Logger>(registry.create(PluginKind::logger, sel.name, sel.options)));
      set.logger_identities.push_back(identity_of(registry, PluginKind::logger, sel.name));
    }
  }
  if (!barebones && config.loggers.empty()) {
    for (const builtin::Default& d : builtin::kDefaults) {
      if (d.kind != PluginKind::logger || !is_default_enabled(d)) continue;
      const std::string name(d.name);
      const Options defaults = default_options(registry.resolve(PluginKind::logger, name).metadata);
      set.loggers.push_back(plugin_cast<Logger>(registry.create(PluginKind::logger, name, defaults)));
      set.logger_identities.push_back(identity_of(registry, PluginKind::logger, name));
    }
  }
  if (barebones) return set;

  for (const auto& sel : config.callbacks) {
    auto callback = create_callback(registry, sel.name, sel.options);
    // fast_dev_run: no checkpoints, no decisions from monitored metrics (Lightning).
    if (fast_dev_run && (callback->roles() & (CallbackRole::monitor | CallbackRole::checkpoint))) continue;
    set.callbacks.push_back({std::move(callback), identity_of(registry, PluginKind::callback, sel.name)});
  }
  for (const builtin::Default& d : builtin::kDefaults) {
    if (d.kind != PluginKind::callback || !is_default_enabled(d)) continue;
    const std::string name(d.name);
    bool configured = false;
    for (const auto& sel : config.callbacks) configured |= sel.name == name;
    if (configured) continue;
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
  // The plugins' own value checks live in their constructors: build each one and let it go.
  for (PluginSelection* sel : config.selections()) {
    try {
      registry.create(sel->kind, sel->name, sel->options);
    } catch (const Error& e) {
      throw Error(e.kind(), fmt::format("{}: {}", sel->where.str(), e.what()));
    }
  }
}

}  // namespace fulgur
