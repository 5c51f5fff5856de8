/// @file
/// Callback: extra behaviour hooked into the Trainer (checkpointing, early stopping, progress...).
/// The hook set and order follow PyTorch Lightning. The Trainer calls only the hooks a callback
/// implements, so an unused hook costs nothing in the loop. What the core needs to know about a
/// callback beyond its hooks it learns from roles(), never from the plugin's name: a third-party
/// callback can take any role a built-in has.
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <type_traits>

struct fulgur_create_args;

namespace fulgur {

class TrainerContext;

/// One callback hook, as a bit of a HookSet. Each value names the Callback method it stands for.
enum class Hook : uint64_t {
  setup = 1ull << 0,                    ///< Callback::setup
  teardown = 1ull << 1,                 ///< Callback::teardown
  fit_start = 1ull << 2,                ///< Callback::on_fit_start
  fit_end = 1ull << 3,                  ///< Callback::on_fit_end
  sanity_check_start = 1ull << 4,       ///< Callback::on_sanity_check_start
  sanity_check_end = 1ull << 5,         ///< Callback::on_sanity_check_end
  train_start = 1ull << 6,              ///< Callback::on_train_start
  train_end = 1ull << 7,                ///< Callback::on_train_end
  train_epoch_start = 1ull << 8,        ///< Callback::on_train_epoch_start
  train_epoch_end = 1ull << 9,          ///< Callback::on_train_epoch_end
  train_batch_start = 1ull << 10,       ///< Callback::on_train_batch_start
  train_batch_end = 1ull << 11,         ///< Callback::on_train_batch_end
  validation_start = 1ull << 12,        ///< Callback::on_validation_start
  validation_end = 1ull << 13,          ///< Callback::on_validation_end
  validation_epoch_start = 1ull << 14,  ///< Callback::on_validation_epoch_start
  validation_epoch_end = 1ull << 15,    ///< Callback::on_validation_epoch_end
  validation_batch_start = 1ull << 16,  ///< Callback::on_validation_batch_start
  validation_batch_end = 1ull << 17,    ///< Callback::on_validation_batch_end
  test_start = 1ull << 18,              ///< Callback::on_test_start
  test_end = 1ull << 19,                ///< Callback::on_test_end
  test_epoch_start = 1ull << 20,        ///< Callback::on_test_epoch_start
  test_epoch_end = 1ull << 21,          ///< Callback::on_test_epoch_end
  test_batch_start = 1ull << 22,        ///< Callback::on_test_batch_start
  test_batch_end = 1ull << 23,          ///< Callback::on_test_batch_end
  predict_start = 1ull << 24,           ///< Callback::on_predict_start
  predict_end = 1ull << 25,             ///< Callback::on_predict_end
  predict_epoch_start = 1ull << 26,     ///< Callback::on_predict_epoch_start
  predict_epoch_end = 1ull << 27,       ///< Callback::on_predict_epoch_end
  predict_batch_start = 1ull << 28,     ///< Callback::on_predict_batch_start
  predict_batch_end = 1ull << 29,       ///< Callback::on_predict_batch_end
  before_backward = 1ull << 30,         ///< Callback::on_before_backward
  after_backward = 1ull << 31,          ///< Callback::on_after_backward
  before_optimizer_step = 1ull << 32,   ///< Callback::on_before_optimizer_step
  before_zero_grad = 1ull << 33,        ///< Callback::on_before_zero_grad
  exception = 1ull << 34,               ///< Callback::on_exception
  save_checkpoint = 1ull << 35,         ///< Callback::on_save_checkpoint
  load_checkpoint = 1ull << 36,         ///< Callback::on_load_checkpoint
};

/// A set of hooks: Hook values or-ed together (`Hook::fit_start | Hook::fit_end`).
using HookSet = uint64_t;
/// Number of hooks; the Hook values are the bits 0 .. kHookCount - 1.
inline constexpr int kHookCount = 37;
/// The hook's name as Lightning spells it ("on_train_epoch_end", "setup"), for messages and
/// profiler scopes: static storage. nullptr for a value that is not a single hook.
FULGUR_SDK_API const char* hook_name(Hook hook);
/// The set of two hooks.
constexpr HookSet operator|(Hook a, Hook b) { return static_cast<HookSet>(a) | static_cast<HookSet>(b); }
/// `set` with `b` added.
constexpr HookSet operator|(HookSet a, Hook b) { return a | static_cast<HookSet>(b); }
/// Whether `set` holds `hook`.
constexpr bool has_hook(HookSet set, Hook hook) { return (set & static_cast<HookSet>(hook)) != 0; }

/// What a callback is to the Trainer, as flags (declared through Callback::roles()).
enum class CallbackRole : uint32_t {
  /// Decides from monitored metrics (early stopping, checkpoint selection): at the end of a
  /// training epoch it runs after the Module's on_train_epoch_end, so it sees the epoch's values;
  /// fast_dev_run leaves it out.
  monitor = 1u << 0,
  /// Writes checkpoints: runs after every other callback at each hook (Lightning's order), so the
  /// state it saves includes what the others did; fast_dev_run leaves it out, and one configured
  /// replaces the default checkpoint callback. A checkpoint callback usually also answers
  /// checkpoint_provider().
  checkpoint = 1u << 1,
};
/// A set of roles: CallbackRole values or-ed together; 0 for none.
using CallbackRoles = uint32_t;
/// The set of two roles.
constexpr CallbackRoles operator|(CallbackRole a, CallbackRole b) {
  return static_cast<CallbackRoles>(a) | static_cast<CallbackRoles>(b);
}
/// Whether `roles` holds `role`.
constexpr bool has_role(CallbackRoles roles, CallbackRole role) {
  return (roles & static_cast<CallbackRoles>(role)) != 0;
}

/// A source of checkpoints the Trainer can resume from: it answers ckpt_path = "best" / "last".
/// Reached through Callback::checkpoint_provider(); owned by the callback (usually the callback
/// itself). Asked on every rank when a stage starts from ckpt_path "best" or "last", after the
/// callbacks' setup; the callbacks that provide checkpoints are asked in order and the first
/// non-empty answer wins (for "last", rank zero's answer is then broadcast). What a method throws
/// ends the stage with a fulgur::Error naming the callback.
class FULGUR_SDK_API CheckpointProvider {
 public:
  virtual ~CheckpointProvider();
  /// The best checkpoint by this provider's monitor, saved in this process's run or recorded in
  /// the state it was restored from; empty when none is known.
  virtual std::string best_checkpoint_path(TrainerContext& trainer) = 0;
  /// The newest "last" checkpoint: written in this run, or found on disk where this provider saves
  /// (a new process resuming a killed run); empty when there is none.
  virtual std::string last_checkpoint_path(TrainerContext& trainer) = 0;
  /// Where and under which names it saves, for messages (`<dir>/last*.ckpt`).
  virtual std::string describe_location(TrainerContext& trainer) = 0;
};

/// Extra behaviour hooked into the Trainer. Created by the registry when the Trainer is built (or
/// handed to Trainer::add_callback) and owned by the Trainer for its whole life; hooks() and
/// roles() are read once, when it is added.
///
/// Every hook is called on every rank, from the thread that runs the stage, only if hooks() lists
/// it; callbacks run in configuration order, except that checkpoint-role callbacks run after all
/// others. The order within fit (Lightning's):
///
/// - setup, [on_load_checkpoint, load_state_dict when resuming], on_fit_start,
///   [on_sanity_check_start, a validation pass, on_sanity_check_end], on_train_start;
/// - each epoch: on_train_epoch_start, each batch (on_train_batch_start, [on_before_zero_grad],
///   on_before_backward, on_after_backward, [on_before_optimizer_step], on_train_batch_end,
///   [a validation pass]), [a validation pass], on_train_epoch_end;
/// - on_train_end, on_fit_end, teardown.
///
/// A validation or test pass is on_*_start, on_*_epoch_start, per batch on_*_batch_start and
/// on_*_batch_end, on_*_epoch_end, on_*_end; predict is the same with predict. A hook that throws
/// ends the stage: on_exception runs, then teardown, and the caller of fit/validate/test/predict
/// gets a fulgur::Error naming the callback, the hook, the epoch and the global step. Hooks may use
/// the TrainerContext's collectives only when every rank makes the same calls in the same order.
///
/// Derive from CallbackBase<YourClass> so that hooks() follows your overrides, or derive from
/// Callback and list them in hooks() (a plugin that overrides a hook it did not list is warned
/// about when it is created).
class FULGUR_SDK_API Callback {
 public:
  virtual ~Callback();

  /// The hooks this callback implements; the others are never called. Read once, when the
  /// callback is added to the Trainer. CallbackBase<Derived> derives the set from the overrides.
  virtual HookSet hooks() const = 0;
  /// Roles (CallbackRole flags); 0 = an ordinary callback. Read when the callback is created and
  /// added to the Trainer.
  virtual CallbackRoles roles() const { return 0; }
  /// Non-null when this callback can answer ckpt_path = "best" / "last"; the provider stays owned
  /// by the callback and must live as long as it. Asked whenever such a path is resolved.
  virtual CheckpointProvider* checkpoint_provider() { return nullptr; }

  /// Start of every stage (`stage` is the one starting: fit, validate, test or predict), after the
  /// process group is up, before the DataModule's setup and the model's configure_model (and, in
  /// fit, before configure_optimizers). In fit, the place to change the training batch size or run
  /// batch-size trials.
  virtual void setup(TrainerContext&, Stage) {}
  /// End of every stage, also one that failed or was interrupted. What this throws is reported
  /// after the other end-of-stage steps ran; in a stage that failed already it is dropped.
  virtual void teardown(TrainerContext&, Stage) {}
  /// Once per fit, with the model and optimizers set up and, when resuming, the weights and the
  /// callbacks' state restored (the optimizer, scheduler, precision and loop state are restored
  /// right after this hook), before the sanity check.
  virtual void on_fit_start(TrainerContext&) {}
  /// Once per fit that ran to its end, after on_train_end.
  virtual void on_fit_end(TrainerContext&) {}
  /// Before the few validation batches fit runs before training (num_sanity_val_steps), when it
  /// runs them; TrainerContext::sanity_checking() is true until on_sanity_check_end.
  virtual void on_sanity_check_start(TrainerContext&) {}
  /// After the sanity check's validation pass; its metrics are discarded after this hook.
  virtual void on_sanity_check_end(TrainerContext&) {}
  /// Once per fit, before the first training epoch (the model is in training mode).
  virtual void on_train_start(TrainerContext&) {}
  /// Once per fit, after the last training epoch (also when training stopped early).
  virtual void on_train_end(TrainerContext&) {}
  /// Start of every training epoch, before its first batch. The place to change
  /// accumulate_grad_batches.
  virtual void on_train_epoch_start(TrainerContext&) {}
  /// End of every training epoch, after its validation pass (if any). Ordinary callbacks run
  /// first, then the Module's on_train_epoch_end, then the monitor-role callbacks.
  virtual void on_train_epoch_end(TrainerContext&) {}
  /// Every training batch, before training_step: `batch` is on the device; `batch_idx` counts the
  /// epoch's batches from 0. On the hot path: a value read from the device here (`.item()`)
  /// waits for the queued work.
  virtual void on_train_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  /// Every training batch, after its backward and (on the last batch of an accumulation window) its
  /// optimizer step, before a validation pass due after it; `output` is what training_step returned
  /// (the loss not divided by the accumulation). On the hot path, as on_train_batch_start.
  virtual void on_train_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t /*batch_idx*/) {}
  /// Start of every validation pass (the sanity check's, those inside fit, Trainer::validate).
  virtual void on_validation_start(TrainerContext&) {}
  /// End of every validation pass, after its metrics were reduced (outside the sanity check,
  /// callback_metrics holds them).
  virtual void on_validation_end(TrainerContext&) {}
  /// After on_validation_start, before the pass's first batch (of its first loader).
  virtual void on_validation_epoch_start(TrainerContext&) {}
  /// After the pass's last batch (of every loader), before its metrics are reduced.
  virtual void on_validation_epoch_end(TrainerContext&) {}
  /// Every validation batch, before validation_step (in eval mode, without gradients);
  /// TrainerContext::dataloader_idx() says which loader.
  virtual void on_validation_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  /// Every validation batch, after validation_step with its output.
  virtual void on_validation_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t /*batch_idx*/) {}
  /// Start of Trainer::test's pass.
  virtual void on_test_start(TrainerContext&) {}
  /// End of the test pass, after its metrics were reduced.
  virtual void on_test_end(TrainerContext&) {}
  /// After on_test_start, before the first batch.
  virtual void on_test_epoch_start(TrainerContext&) {}
  /// After the last batch (of every loader), before the metrics are reduced.
  virtual void on_test_epoch_end(TrainerContext&) {}
  /// Every test batch, before test_step (in eval mode, without gradients).
  virtual void on_test_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  /// Every test batch, after test_step with its output.
  virtual void on_test_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t /*batch_idx*/) {}
  /// Start of Trainer::predict's pass.
  virtual void on_predict_start(TrainerContext&) {}
  /// End of the predict pass.
  virtual void on_predict_end(TrainerContext&) {}
  /// After on_predict_start, before the first batch.
  virtual void on_predict_epoch_start(TrainerContext&) {}
  /// After the last batch, before on_predict_end.
  virtual void on_predict_epoch_end(TrainerContext&) {}
  /// Every predict batch, before predict_step (in eval mode, without gradients).
  virtual void on_predict_batch_start(TrainerContext&, const Batch&, int64_t /*batch_idx*/) {}
  /// Every predict batch, after predict_step with its prediction.
  virtual void on_predict_batch_end(TrainerContext&, const at::Tensor& /*prediction*/, const Batch&,
                                    int64_t /*batch_idx*/) {}
  /// Before each backward: every training batch whose step returned a loss (`loss` is already
  /// divided by accumulate_grad_batches), and each manual_backward under manual optimization.
  /// Implementing it keeps training steps from being captured (cuda_graphs).
  virtual void on_before_backward(TrainerContext&, const at::Tensor& /*loss*/) {}
  /// After each backward (gradients of this micro-batch accumulated, not yet unscaled).
  /// Implementing it keeps training steps from being captured (cuda_graphs).
  virtual void on_after_backward(TrainerContext&) {}
  /// Before each optimizer step, after the precision unscaled the gradients and before clipping.
  /// Gradients are unscaled (true values) when this runs. Implementing it keeps training steps
  /// from being captured (cuda_graphs).
  virtual void on_before_optimizer_step(TrainerContext&, torch::optim::Optimizer&) {}
  /// Before the gradients are zeroed: once per accumulation window, before its first backward
  /// (automatic optimization). Implementing it keeps training steps from being captured
  /// (cuda_graphs).
  virtual void on_before_zero_grad(TrainerContext&, torch::optim::Optimizer&) {}
  /// An exception is ending the stage (not a signal: that is an orderly stop), before teardown.
  /// `exception` is the error the caller will get. What this throws is logged and dropped.
  virtual void on_exception(TrainerContext&, const std::exception&) {}
  /// A checkpoint is being saved (TrainerContext::save_checkpoint from any callback, a signal):
  /// on every rank, also for weights-only checkpoints, after the callbacks' state_dict was
  /// collected. `checkpoint` is the checkpoint dict (c10::impl::GenericDict) being written: every
  /// top-level key except the model and optimizer state, which the Strategy owns (it may hold
  /// shards of them); keys added here are saved.
  virtual void on_save_checkpoint(TrainerContext&, c10::IValue& /*checkpoint*/) {}
  /// Fit is resuming from a checkpoint: `checkpoint` is the dict just read (as on_save_checkpoint
  /// saw it). Called after setup (the model holds the checkpoint's weights) and before this
  /// callback's load_state_dict and on_fit_start. Not called by validate/test/predict, which
  /// restore only the weights.
  virtual void on_load_checkpoint(TrainerContext&, const c10::IValue& /*checkpoint*/) {}

  /// Callback state stored under checkpoint["callbacks"][state_key()]; empty key = stateless.
  /// Stable across runs and unique among the run's callbacks. Read at every save and restore.
  virtual std::string state_key() const { return {}; }
  /// This callback's state for a full checkpoint, written into `out` (leave it None to store
  /// nothing). Called on every rank at each full (not weights-only) checkpoint save.
  virtual void state_dict(c10::IValue& /*out*/) const {}
  /// Restores what state_dict wrote. Called when fit resumes from a checkpoint holding an entry
  /// under state_key(), after on_load_checkpoint. Throws fulgur::Error(checkpoint) for a state it
  /// cannot read.
  virtual void load_state_dict(const c10::IValue& /*state*/) {}
  /// The extension interface named `id` that this callback implements, or nullptr (the default).
  /// Capabilities added after SDK 1.0 arrive this way; see fulgur/extension.h. Must not throw.
  virtual void* extension(std::string_view id) noexcept;
};

namespace detail {
/// Hook `hook` when D overrides `fn`: &D::fn no longer has the type of Callback's own member.
#define FULGUR_HOOK_OVERRIDDEN(D, fn, hook) \
  (std::is_same_v<decltype(&D::fn), decltype(&Callback::fn)> ? HookSet{0} : static_cast<HookSet>(hook))
/// The hooks class D overrides, computed at compile time.
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

/// A callback that overrides hooks its hooks() does not list would never see them: FULGUR_PLUGIN's
/// factory says so once, as a warning, when it is created (CallbackBase<T> derives the list: never
/// a gap). A callback that leaves hooks out on purpose, depending on its options, names them in
/// `static constexpr fulgur::HookSet kConditionalHooks`. Does not throw.
FULGUR_SDK_API void warn_undeclared_hooks(const Callback& callback, HookSet overridden, const fulgur_create_args* args);
}  // namespace detail

/// Derive from CallbackBase<YourClass>: hooks() is the set of hooks YourClass overrides, computed
/// at compile time, so the declaration can never drift from the code.
///
/// @code
///   class Hello : public fulgur::CallbackBase<Hello> {
///     void on_fit_start(fulgur::TrainerContext&) override { ... }
///   };
/// @endcode
template <class Derived>
class CallbackBase : public Callback {
 public:
  /// The hooks Derived overrides (a constant).
  HookSet hooks() const override { return detail::overridden_hooks<Derived>(); }
};

}  // namespace fulgur
