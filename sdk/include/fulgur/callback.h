// Callback: extra behaviour hooked into the Trainer (checkpointing, early stopping, progress...).
// The hook set and order follow PyTorch Lightning. A callback declares the hooks it implements
// in hooks(); the Trainer calls only those, so an unused hook costs nothing in the loop.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <cstdint>
#include <exception>
#include <string>

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
constexpr HookSet operator|(Hook a, Hook b) { return static_cast<HookSet>(a) | static_cast<HookSet>(b); }
constexpr HookSet operator|(HookSet a, Hook b) { return a | static_cast<HookSet>(b); }
constexpr bool has_hook(HookSet set, Hook hook) { return (set & static_cast<HookSet>(hook)) != 0; }

class FULGUR_SDK_API Callback {
 public:
  virtual ~Callback();

  // The hooks this callback implements; the others are never called.
  virtual HookSet hooks() const = 0;

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
  // `checkpoint` is the checkpoint dict (c10::impl::GenericDict) being written / just read.
  virtual void on_save_checkpoint(TrainerContext&, c10::IValue& /*checkpoint*/) {}
  virtual void on_load_checkpoint(TrainerContext&, const c10::IValue& /*checkpoint*/) {}

  // Callback state stored under checkpoint["callbacks"][state_key()]; empty key = stateless.
  virtual std::string state_key() const { return {}; }
  virtual void state_dict(c10::IValue& /*out*/) const {}
  virtual void load_state_dict(const c10::IValue& /*state*/) {}
};

}  // namespace fulgur
