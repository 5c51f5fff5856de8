// Internal: the one path every callback, module and logger hook call takes. Each call opens a
// profiler scope ("[Callback]model_checkpoint.on_train_epoch_end", "[Module]Net.on_fit_start") and
// turns an exception into a fulgur::Error that names the plugin kind, name, file, the hook, and
// the epoch and global step it was raised at.
#pragma once

#include <fulgur/callback.h>
#include <fulgur/error.h>
#include <fulgur/logger.h>
#include <fulgur/profiler.h>
#include <fulgur/registry/crash_report.h>

#include <array>
#include <bit>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

// Who runs the code a hook call enters, for profiler scopes and error messages.
struct PluginIdentity {
  std::string kind;  // "callback", "logger", "module"
  std::string name;  // plugin name, or the Module's class name
  std::string file;  // the plugin's library; empty for code built into the program
};

// Where the run is when a hook fails.
struct RunPosition {
  int64_t epoch = 0;
  int64_t global_step = 0;
};

// What the Trainer is running when a hook fails: the stage ("fit", "validate", "sanity check"...),
// whether it is part of fit (then the epoch and global step mean something), and the batch (-1:
// between batches).
struct StageContext {
  const char* stage = "fit";
  bool in_fit = true;
  int64_t batch_idx = -1;
};

// Rethrows the exception in flight as a fulgur::Error naming `who`, `hook` and `where` (and, when
// given, the stage and batch); an exception that already names a plugin (raised by a nested
// dispatch) passes unchanged. A libtorch error keeps its message; its C++ stack frames are logged
// at debug level only (they describe libtorch, not the user's code).
[[noreturn]] void rethrow_attributed(const PluginIdentity& who, std::string_view hook, const RunPosition& where,
                                     const StageContext* context = nullptr);

class HookDispatcher {
 public:
  struct Slot {
    std::shared_ptr<Callback> callback;
    PluginIdentity identity;
    CallbackRoles roles = 0;
    HookSet hooks = 0;
    std::array<std::string, kHookCount> scope_names;  // built once: ProfileScope keeps a view
    std::array<std::string, kHookCount> crash_texts;  // built once: a fatal signal names them
  };

  HookDispatcher(const Profiler* const& profiler, const RunPosition& position)
      : profiler_(profiler), position_(position) {
    install_crash_reporter();
  }

  // Checkpoint-role callbacks run after all others (Lightning runs ModelCheckpoint last, so it
  // saves what every other callback did); otherwise insertion order.
  void add(std::shared_ptr<Callback> callback, PluginIdentity identity);
  const std::vector<Slot>& slots() const { return slots_; }
  std::vector<Slot>& slots() { return slots_; }

  // Calls `fn(callback)` on every callback that implements `hook` (nothing for the others).
  template <class Fn>
  void call(Hook hook, Fn&& fn) {
    for (Slot* slot : by_hook_[index(hook)]) invoke(*slot, hook, fn);
  }
  // The same, restricted to callbacks with (monitors = true) or without the monitor role: the
  // end of a training epoch runs the others, then the Module, then the monitors.
  template <class Fn>
  void call_where_monitor(Hook hook, bool monitors, Fn&& fn) {
    for (Slot* slot : by_hook_[index(hook)])
      if (has_role(slot->roles, CallbackRole::monitor) == monitors) invoke(*slot, hook, fn);
  }
  // During failure handling: every callback's on_exception, each failure logged, none thrown.
  void call_on_exception(const std::function<void(Callback&)>& fn);

  // A Module hook: `fn()` inside the scope "[Module]<name>.<hook>", attributed on failure.
  template <class Fn>
  decltype(auto) module(const char* hook, Fn&& fn) {
    ProfileScope scope(profiler(), profiler_ ? module_scope(hook) : std::string_view());
    const CrashScope crash(crash_text(module_identity_, hook), &position_.epoch, &position_.global_step);
    try {
      return fn();
    } catch (...) {
      rethrow_attributed(module_identity_, hook, position_, &context_);
    }
  }
  // A Module step (training_step, validation_step, ...): the loops keep their own profiler
  // scopes; only the attribution is added (a try block costs nothing until something throws).
  template <class Fn>
  decltype(auto) module_step(const char* hook, Fn&& fn) {
    try {
      return fn();
    } catch (...) {
      rethrow_attributed(module_identity_, hook, position_, &context_);
    }
  }

  // The stage and batch errors name. A Scope sets them for its lifetime (a validation run inside
  // fit, one batch) and restores the outer ones after.
  void set_stage(const char* stage, bool in_fit) { context_ = {stage, in_fit, -1}; }
  class Scope {
   public:
    Scope(HookDispatcher& hooks, const char* stage, int64_t batch_idx) : hooks_(hooks), saved_(hooks.context_) {
      if (stage) hooks.context_.stage = stage;
      hooks.context_.batch_idx = batch_idx;
    }
    ~Scope() { hooks_.context_ = saved_; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    HookDispatcher& hooks_;
    StageContext saved_;
  };
  void set_module_name(std::string name) {
    module_identity_ = {"module", std::move(name), {}};
    crash_texts_.clear();  // between stages, when no hook runs: they name the module
  }

  // A logger method, attributed on failure to the logger.
  template <class Fn>
  void logger(const PluginIdentity& who, const char* method, Fn&& fn) {
    const CrashScope crash(crash_text(who, method), &position_.epoch, &position_.global_step);
    try {
      fn();
    } catch (...) {
      rethrow_attributed(who, method, position_);
    }
  }

 private:
  static int index(Hook hook) { return std::countr_zero(static_cast<uint64_t>(hook)); }
  Profiler* profiler() const { return const_cast<Profiler*>(profiler_); }
  std::string_view module_scope(const char* hook);
  // "logger 'csv' (/path/libcsv.so), hook log_metrics", formatted on first use and kept (keyed by
  // the identity's and the hook literal's addresses: a pointer comparison per call).
  const char* crash_text(const PluginIdentity& who, const char* hook);

  template <class Fn>
  void invoke(Slot& slot, Hook hook, Fn& fn) {
    ProfileScope scope(profiler(), profiler_ ? std::string_view(slot.scope_names[index(hook)]) : std::string_view());
    const CrashScope crash(slot.crash_texts[index(hook)].c_str(), &position_.epoch, &position_.global_step);
    try {
      fn(*slot.callback);
    } catch (...) {
      rethrow_attributed(slot.identity, hook_name(hook), position_);
    }
  }
  void reindex();

  const Profiler* const& profiler_;
  const RunPosition& position_;
  std::vector<Slot> slots_;
  std::array<std::vector<Slot*>, 64> by_hook_;
  PluginIdentity module_identity_{"module", "Module", {}};
  StageContext context_;
  std::deque<std::pair<std::string, std::string>> module_scopes_;  // hook -> scope (stable addresses)
  struct CrashText {
    const PluginIdentity* who;
    const char* hook;
    std::string text;
  };
  std::deque<CrashText> crash_texts_;  // stable addresses
};

}  // namespace fulgur
