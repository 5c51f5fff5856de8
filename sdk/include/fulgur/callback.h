// Callback: extra behaviour hooked into the Trainer (checkpointing, early stopping, progress...).
// The hook set and order follow PyTorch Lightning. The Trainer calls only the hooks a callback
// implements, so an unused hook costs nothing in the loop: derive from CallbackBase<YourClass> and
// the set is read from your overrides at compile time, or derive from Callback and list them in
// hooks() (a plugin that overrides a hook it did not list is warned about when it is created).
//
// What the core needs to know about a callback beyond its hooks it learns from roles(), never from
// the plugin's name: a third-party callback can take any role a built-in has.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>

struct fulgur_create_args;

namespace fulgur {

class TrainerContext;

enum class Hook : uint64_t {
  setup = 1ull << 0,
  teardown = 1ull << 1,
  fit_start = 1ull << 2,
  fit_end = 1ull << 3,
  sanity_check_start = 1ull << 4,
  sanity_check_end = 1ull << 5,
  train_start = 1ull << 6,
  train_end = 1ull << 7,
  train_epoch_start = 1ull << 8,
  train_epoch_end = 1ull << 9,
  train_batch_start = 1ull << 10,
  train_batch_end = 1ull << 11,
  validation_start = 1ull << 12,
  validation_end = 1ull << 13,
  validation_epoch_start = 1ull << 14,
  validation_epoch_end = 1ull << 15,
  validation_batch_start = 1ull << 16,
  validation_batch_end = 1ull << 17,
  test_start = 1ull << 18,
  test_end = 1ull << 19,
  test_epoch_start = 1ull << 20,
  test_epoch_end = 1ull << 21,
  test_batch_start = 1ull << 22,
  test_batch_end = 1ull << 23,
  predict_start = 1ull << 24,
  predict_end = 1ull << 25,
  predict_epoch_start = 1ull << 26,
  predict_epoch_end = 1ull << 27,
  predict_batch_start = 1ull << 28,
  predict_batch_end = 1ull << 29,
  before_backward = 1ull << 30,
  after_backward = 1ull << 31,
  before_optimizer_step = 1ull << 32,
  before_zero_grad = 1ull << 33,
  exception = 1ull << 34,
  save_checkpoint = 1ull << 35,
  load_checkpoint = 1ull << 36,
};

using HookSet = uint64_t;
inline constexpr int kHookCount = 37;
// The hook's name as Lightning spells it ("on_train_epoch_end", "setup"), for messages and
// profiler scopes; nullptr for a value that is not a single hook.
FULGUR_SDK_API const char* hook_name(Hook hook);
constexpr HookSet operator|(Hook a, Hook b) { return static_cast<HookSet>(a) | static_cast<HookSet>(b); }
constexpr HookSet operator|(HookSet a, Hook b) { return a | static_cast<HookSet>(b); }
constexpr bool has_hook(HookSet set, Hook hook) { return (set & static_cast<HookSet>(hook)) != 0; }

// What a callback is to the Trainer, as flags (declared through Callback::roles()).
enum class CallbackRole : uint32_t {
  // Decides from monitored metrics (early stopping, checkpoint selection): at the end of a
  // training epoch it runs after the Module's on_train_epoch_end, so it sees the epoch's values;
  // fast_dev_run leaves it out.
  monitor = 1u << 0,
  // Writes checkpoints: runs after every other callback at each hook (Lightning's order), so the
  // state it saves includes what the others did; fast_dev_run leaves it out. A checkpoint callback
  // usually also answers checkpoint_provider().
  checkpoint = 1u << 1,
};
using CallbackRoles = uint32_t;
constexpr CallbackRoles operator|(CallbackRole a, CallbackRole b) {
  return static_cast<CallbackRoles>(a) | static_cast<CallbackRoles>(b);
}
constexpr bool has_role(CallbackRoles roles, CallbackRole role) {
  return (roles & static_cast<CallbackRoles>(role)) != 0;
}

// A source of checkpoints the Trainer can resume from: it answers ckpt_path = "best" / "last".
class FULGUR_SDK_API CheckpointProvider {
 public:
  virtual ~CheckpointProvider();
  // The best checkpoint by this provider's monitor, saved in this process's run or recorded in
  // the state it was restored from; empty when none is known.
  virtual std::string best_checkpoint_path(TrainerContext& trainer) = 0;
  // The newest "last" checkpoint: written in this run, or found on disk where this provider saves
  // (a new process resuming a killed run); empty when there is none.
  virtual std::string last_checkpoint_path(TrainerContext& trainer) = 0;
  // Where and under which names it saves, for messages ("<dir>/last*.ckpt").
  virtual std::string describe_location(TrainerContext& trainer) = 0;
};

class FULGUR_SDK_API Callback {
 public:
  virtual ~Callback();

  // The hooks this callback implements; the others are never called. CallbackBase<Derived>
  // derives the set from the overrides.
  virtual HookSet hooks() const = 0;
  // Roles (CallbackRole flags); 0 = an ordinary callback.
  virtual CallbackRoles roles() const { return 0; }
  // Non-null when this callback can answer ckpt_path = "best" / "last".
  virtual CheckpointProvider* checkpoint_provider() { return nullptr; }

  virtual void setup(TrainerContext&, Stage) {}
  virtual void teardown(TrainerContext&, Stage) {}
  virtual void on_fit_start(TrainerContext&) {}
  virtual void on_fit_end(TrainerContext&) {}
  virtual void on_sanity_check_start(TrainerContext&) {}
  virtual void on_sanity_check_end(TrainerContext&) {}
  virtual void on_train_start(TrainerContext&) {}
  virtual void on_train_end(TrainerContext&) {}
  virtual void on_train_epoch_start(TrainerContext&) {}
  virtual void on_train_epoch_end(TrainerContext&) {}
  virtual void on_train_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_train_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_validation_start(TrainerContext&) {}
  virtual void on_validation_end(TrainerContext&) {}
  virtual void on_validation_epoch_start(TrainerContext&) {}
  virtual void on_validation_epoch_end(TrainerContext&) {}
  virtual void on_validation_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_validation_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_test_start(TrainerContext&) {}
  virtual void on_test_end(TrainerContext&) {}
  virtual void on_test_epoch_start(TrainerContext&) {}
  virtual void on_test_epoch_end(TrainerContext&) {}
  virtual void on_test_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_test_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_predict_start(TrainerContext&) {}
  virtual void on_predict_end(TrainerContext&) {}
  virtual void on_predict_epoch_start(TrainerContext&) {}
  virtual void on_predict_epoch_end(TrainerContext&) {}
  virtual void on_predict_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_predict_batch_end(TrainerContext&, const at::Tensor& /*prediction*/, const Batch&,
                                    int64_t /*batch_idx*/) {}
  virtual void on_before_backward(TrainerContext&, const at::Tensor& /*loss*/) {}
  virtual void on_after_backward(TrainerContext&) {}
  // Gradients are unscaled (true values) when this runs.
  virtual void on_before_optimizer_step(TrainerContext&, torch::optim::Optimizer&) {}
  virtual void on_before_zero_grad(TrainerContext&, torch::optim::Optimizer&) {}
  virtual void on_exception(TrainerContext&, const std::exception&) {}
  // `checkpoint` is the checkpoint dict (c10::impl::GenericDict) being written / just read: every
  // top-level key except the model and optimizer state, which the Strategy owns (it may hold
  // shards of them).
  virtual void on_save_checkpoint(TrainerContext&, c10::IValue& /*checkpoint*/) {}
  virtual void on_load_checkpoint(TrainerContext&, const c10::IValue& /*checkpoint*/) {}

  // Callback state stored under checkpoint["callbacks"][state_key()]; empty key = stateless.
  virtual std::string state_key() const { return {}; }
  virtual void state_dict(c10::IValue& /*out*/) const {}
  virtual void load_state_dict(const c10::IValue& /*state*/) {}
};

namespace detail {
// A hook is overridden when &Derived::on_x no longer has the type of Callback's own member.
#define FULGUR_HOOK_OVERRIDDEN(D, fn, hook) \
  (std::is_same_v<decltype(&D::fn), decltype(&Callback::fn)> ? HookSet{0} : static_cast<HookSet>(hook))
template <class D>
constexpr HookSet overridden_hooks() {
  return FULGUR_HOOK_OVERRIDDEN(D, setup, Hook::setup) | FULGUR_HOOK_OVERRIDDEN(D, teardown, Hook::teardown) |
         FULGUR_HOOK_OVERRIDDEN(D, on_fit_start, Hook::fit_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_fit_end, Hook::fit_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_sanity_check_start, Hook::sanity_check_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_sanity_check_end, Hook::sanity_check_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_train_start, Hook::train_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_train_end, Hook::train_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_train_epoch_start, Hook::train_epoch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_train_epoch_end, Hook::train_epoch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_train_batch_start, Hook::train_batch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_train_batch_end, Hook::train_batch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_validation_start, Hook::validation_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_validation_end, Hook::validation_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_validation_epoch_start, Hook::validation_epoch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_validation_epoch_end, Hook::validation_epoch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_validation_batch_start, Hook::validation_batch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_validation_batch_end, Hook::validation_batch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_test_start, Hook::test_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_test_end, Hook::test_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_test_epoch_start, Hook::test_epoch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_test_epoch_end, Hook::test_epoch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_test_batch_start, Hook::test_batch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_test_batch_end, Hook::test_batch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_predict_start, Hook::predict_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_predict_end, Hook::predict_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_predict_epoch_start, Hook::predict_epoch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_predict_epoch_end, Hook::predict_epoch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_predict_batch_start, Hook::predict_batch_start) |
         FULGUR_HOOK_OVERRIDDEN(D, on_predict_batch_end, Hook::predict_batch_end) |
         FULGUR_HOOK_OVERRIDDEN(D, on_before_backward, Hook::before_backward) |
         FULGUR_HOOK_OVERRIDDEN(D, on_after_backward, Hook::after_backward) |
         FULGUR_HOOK_OVERRIDDEN(D, on_before_optimizer_step, Hook::before_optimizer_step) |
         FULGUR_HOOK_OVERRIDDEN(D, on_before_zero_grad, Hook::before_zero_grad) |
         FULGUR_HOOK_OVERRIDDEN(D, on_exception, Hook::exception) |
         FULGUR_HOOK_OVERRIDDEN(D, on_save_checkpoint, Hook::save_checkpoint) |
         FULGUR_HOOK_OVERRIDDEN(D, on_load_checkpoint, Hook::load_checkpoint);
}
#undef FULGUR_HOOK_OVERRIDDEN

// A callback that overrides hooks its hooks() does not list would never see them: FULGUR_PLUGIN's
// factory says so once, when it is created (CallbackBase<T> derives the list: never a gap). A
// callback that leaves hooks out on purpose, depending on its options, names them in
// `static constexpr fulgur::HookSet kConditionalHooks`.
FULGUR_SDK_API void warn_undeclared_hooks(const Callback& callback, HookSet overridden, const fulgur_create_args* args);
}  // namespace detail

// Derive from CallbackBase<YourClass>: hooks() is the set of hooks YourClass overrides, computed
// at compile time, so the declaration can never drift from the code.
//
//   class Hello : public fulgur::CallbackBase<Hello> {
//     void on_fit_start(fulgur::TrainerContext&) override { ... }
//   };
template <class Derived>
class CallbackBase : public Callback {
 public:
  HookSet hooks() const override { return detail::overridden_hooks<Derived>(); }
};

}  // namespace fulgur
