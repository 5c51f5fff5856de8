// Out-of-line destructors: the key functions that put each interface's vtable and typeinfo in
// the SDK library once, shared by the host and every plugin.
#include <fulgur/accelerator.h>
#include <fulgur/callback.h>
#include <fulgur/communicator.h>
#include <fulgur/log.h>
#include <fulgur/logger.h>
#include <fulgur/options.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/strategy.h>
#include <fulgur/trainer_context.h>

namespace fulgur {

Accelerator::~Accelerator() = default;
Strategy::~Strategy() = default;
Precision::~Precision() = default;
Logger::~Logger() = default;
Profiler::~Profiler() = default;
Callback::~Callback() = default;
CheckpointProvider::~CheckpointProvider() = default;
Communicator::~Communicator() = default;
PendingCollective::~PendingCollective() = default;
GradientSync::~GradientSync() = default;
TrainerContext::~TrainerContext() = default;
StepGraph::~StepGraph() = default;

std::string Accelerator::device_name(const c10::Device& device) const { return device.str(); }
c10::ScalarType Precision::compute_dtype() const { return c10::ScalarType::Float; }

// No extension unless the plugin class lists it (fulgur::WithExtensions).
void* Accelerator::extension(std::string_view) noexcept { return nullptr; }
void* Strategy::extension(std::string_view) noexcept { return nullptr; }
void* Precision::extension(std::string_view) noexcept { return nullptr; }
void* Logger::extension(std::string_view) noexcept { return nullptr; }
void* Profiler::extension(std::string_view) noexcept { return nullptr; }
void* Callback::extension(std::string_view) noexcept { return nullptr; }
void* TrainerContext::extension(std::string_view) noexcept { return nullptr; }

const char* hook_name(Hook hook) {
  static constexpr const char* kNames[kHookCount] = {
      "setup",
      "teardown",
      "on_fit_start",
      "on_fit_end",
      "on_sanity_check_start",
      "on_sanity_check_end",
      "on_train_start",
      "on_train_end",
      "on_train_epoch_start",
      "on_train_epoch_end",
      "on_train_batch_start",
      "on_train_batch_end",
      "on_validation_start",
      "on_validation_end",
      "on_validation_epoch_start",
      "on_validation_epoch_end",
      "on_validation_batch_start",
      "on_validation_batch_end",
      "on_test_start",
      "on_test_end",
      "on_test_epoch_start",
      "on_test_epoch_end",
      "on_test_batch_start",
      "on_test_batch_end",
      "on_predict_start",
      "on_predict_end",
      "on_predict_epoch_start",
      "on_predict_epoch_end",
      "on_predict_batch_start",
      "on_predict_batch_end",
      "on_before_backward",
      "on_after_backward",
      "on_before_optimizer_step",
      "on_before_zero_grad",
      "on_exception",
      "on_save_checkpoint",
      "on_load_checkpoint",
  };
  const auto bits = static_cast<uint64_t>(hook);
  if (bits == 0 || (bits & (bits - 1)) != 0) return nullptr;
  const int index = __builtin_ctzll(bits);
  return index < kHookCount ? kNames[index] : nullptr;
}

const char* to_string(Stage stage) {
  switch (stage) {
    case Stage::fit:
      return "fit";
    case Stage::validate:
      return "validate";
    case Stage::test:
      return "test";
    case Stage::predict:
      return "predict";
    case Stage::sanity_check:
      return "sanity_check";
  }
  return "unknown";
}

const char* to_string(RunStatus status) {
  switch (status) {
    case RunStatus::success:
      return "success";
    case RunStatus::failed:
      return "failed";
    case RunStatus::interrupted:
      return "interrupted";
  }
  return "unknown";
}

}  // namespace fulgur

namespace fulgur::detail {

void warn_undeclared_hooks(const Callback& callback, HookSet overridden, const fulgur_create_args* args) {
  const HookSet missing = overridden & ~callback.hooks();
  if (missing == 0) return;
  std::string names;
  for (int bit = 0; bit < kHookCount; ++bit)
    if (missing & (uint64_t{1} << bit)) {
      if (!names.empty()) names += ", ";
      names += hook_name(static_cast<Hook>(uint64_t{1} << bit));
    }
  std::string owner = "a callback";
  if (args && args->options) owner = static_cast<const Options*>(args->options)->owner();
  if (owner.empty()) owner = "a callback";
  log::warn(owner + " overrides " + names +
            " but does not list them in hooks(), so they are never called; add them to hooks() or derive from "
            "fulgur::CallbackBase<YourClass>");
}

}  // namespace fulgur::detail
