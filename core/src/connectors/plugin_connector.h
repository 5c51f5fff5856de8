// Internal: which plugin objects a run uses, created from the config through the registry.
#pragma once

#include <fulgur/accelerator.h>
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/logger.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/registry/registry.h>
#include <fulgur/strategy.h>

#include <memory>
#include <vector>

#include "../hook_dispatcher.h"

namespace fulgur {

struct PluginSet {
  std::unique_ptr<PluginRegistry> registry;  // first member: the libraries outlive the objects
  std::shared_ptr<Accelerator> accelerator;
  std::shared_ptr<Strategy> strategy;
  std::shared_ptr<Precision> precision;
  std::shared_ptr<Profiler> profiler;
  std::vector<std::shared_ptr<Logger>> loggers;
  std::vector<PluginIdentity> logger_identities;
  struct CallbackEntry {
    std::shared_ptr<Callback> callback;
    PluginIdentity identity;
  };
  std::vector<CallbackEntry> callbacks;
  // The optional extensions the Trainer's fast paths use (fulgur/extension.h), looked up once
  // when the plugins are created; null where the plugin does not offer them.
  StepGraphFactory* step_graphs = nullptr;            // accelerator: captured steps
  StagedTransfers* staged_transfers = nullptr;        // accelerator: copies on a side stream
  DeviceStepStrategy* strategy_device_step = nullptr;  // strategy: capture, delegated steps
  DeviceStepPrecision* precision_device_step = nullptr;  // precision: found_inf on the device
};

// Validates every plugin table against its schema, then creates the selected plugins and the
// default set (fulgur/builtin_plugins.h) in the order they run.
PluginSet connect_plugins(Config& config, bool fast_dev_run);

}  // namespace fulgur
