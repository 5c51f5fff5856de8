#include "hook_dispatcher.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>

namespace fulgur {

namespace {

// An error already attributed to a plugin and hook: outer dispatch levels let it through.
class AttributedError : public Error {
 public:
  using Error::Error;
};

std::string describe(const PluginIdentity& who) {
  std::string text = fmt::format("{} '{}'", who.kind, who.name);
  if (!who.file.empty()) text += fmt::format(" ({})", who.file);
  return text;
}

std::string crash_description(const PluginIdentity& who, std::string_view hook) {
  return fmt::format("{} '{}' ({}), hook {}", who.kind, who.name,
                     who.file.empty() ? "built into the program" : who.file, hook);
}

}  // namespace

void rethrow_attributed(const PluginIdentity& who, std::string_view hook, const RunPosition& where,
                        const StageContext* context) {
  std::string place;
  if (!context) {
    place =
        fmt::format("{} failed in {} at epoch {}, global step {}", describe(who), hook, where.epoch, where.global_step);
  } else {
    const std::string batch = context->batch_idx >= 0 ? fmt::format(", batch {}", context->batch_idx) : "";
    place = context->in_fit ? fmt::format("{} failed in {} (stage {}, epoch {}{}, global step {})", describe(who), hook,
                                          context->stage, where.epoch, batch, where.global_step)
                            : fmt::format("{} failed in {} (stage {}{})", describe(who), hook, context->stage, batch);
  }
  try {
    throw;
  } catch (const AttributedError&) {
    throw;
  } catch (const Error& e) {
    throw AttributedError(e.kind(), fmt::format("{}: {}", place, e.what()));
  } catch (const c10::Error& e) {
    // The message says what is wrong (shapes, dtypes); the frames only where libtorch raised it.
    spdlog::debug("{}: libtorch's stack at the error:\n{}", place, e.what());
    throw AttributedError(ErrorKind::runtime, fmt::format("{}: {}", place, e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw AttributedError(ErrorKind::runtime, fmt::format("{}: {}", place, e.what()));
  } catch (...) {
    throw AttributedError(ErrorKind::runtime, fmt::format("{}: an exception not derived from std::exception", place));
  }
}

void HookDispatcher::add(std::shared_ptr<Callback> callback, PluginIdentity identity) {
  Slot slot;
  slot.hooks = callback->hooks();
  slot.roles = callback->roles();
  slot.callback = std::move(callback);
  slot.identity = std::move(identity);
  for (int bit = 0; bit < kHookCount; ++bit) {
    const auto hook = static_cast<Hook>(uint64_t{1} << bit);
    slot.scope_names[bit] = fmt::format("[Callback]{}.{}", slot.identity.name, hook_name(hook));
    slot.crash_texts[bit] = crash_description(slot.identity, hook_name(hook));
  }
  if (has_role(slot.roles, CallbackRole::checkpoint)) {
    slots_.push_back(std::move(slot));
  } else {
    auto first_checkpoint = std::find_if(slots_.begin(), slots_.end(),
                                         [](const Slot& s) { return has_role(s.roles, CallbackRole::checkpoint); });
    slots_.insert(first_checkpoint, std::move(slot));
  }
  reindex();
}

void HookDispatcher::reindex() {
  for (auto& list : by_hook_) list.clear();
  for (auto& slot : slots_)
    for (int bit = 0; bit < 64; ++bit)
      if (slot.hooks & (uint64_t{1} << bit)) by_hook_[bit].push_back(&slot);
}

void HookDispatcher::call_on_exception(const std::function<void(Callback&)>& fn) {
  for (Slot* slot : by_hook_[index(Hook::exception)]) {
    try {
      fn(*slot->callback);
    } catch (const std::exception& e) {
      spdlog::error("{} failed in on_exception while handling another error: {}", describe(slot->identity), e.what());
    } catch (...) {
      spdlog::error("{} failed in on_exception while handling another error", describe(slot->identity));
    }
  }
}

const char* HookDispatcher::crash_text(const PluginIdentity& who, const char* hook) {
  for (const CrashText& t : crash_texts_)
    if (t.who == &who && t.hook == hook) return t.text.c_str();
  crash_texts_.push_back({&who, hook, crash_description(who, hook)});
  return crash_texts_.back().text.c_str();
}

std::string_view HookDispatcher::module_scope(const char* hook) {
  for (const auto& [h, scope] : module_scopes_)
    if (h == hook) return scope;
  module_scopes_.emplace_back(hook, fmt::format("[Module]{}.{}", module_identity_.name, hook));
  return module_scopes_.back().second;
}

}  // namespace fulgur
