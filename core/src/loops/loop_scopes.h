// Internal: RAII scopes the loops open around steps and hooks.
#pragma once

#include <fulgur/module.h>

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>

#include <optional>

#include "../binding.h"
#include "../metric_store.h"

namespace fulgur {

// Sets what Module::log may do for the duration of a hook or step: which store receives values,
// whether they default to step level (training) and whether logging is allowed at all.
class LogContext {
 public:
  // `hook` names the hook for the "not allowed" error where no hook dispatch names it (predict_step).
  LogContext(Module::Binding& b, MetricStore* store, bool training, bool allowed, const char* hook = nullptr)
      : b_(b),
        saved_store_(b.metrics),
        saved_training_(b.training_context),
        saved_allowed_(b.logging_allowed),
        saved_hook_(b.log_hook) {
    b_.metrics = store;
    b_.training_context = training;
    b_.logging_allowed = allowed;
    b_.log_hook = hook;
  }
  ~LogContext() {
    b_.metrics = saved_store_;
    b_.training_context = saved_training_;
    b_.logging_allowed = saved_allowed_;
    b_.log_hook = saved_hook_;
  }
  LogContext(const LogContext&) = delete;
  LogContext& operator=(const LogContext&) = delete;

 private:
  Module::Binding& b_;
  MetricStore* saved_store_;
  bool saved_training_, saved_allowed_;
  const char* saved_hook_;
};

// Lightning evaluates under inference mode (or no_grad) with the model in eval mode, then puts
// the model back in the mode it was in.
class EvalMode {
 public:
  EvalMode(torch::nn::Module& m, bool inference) : m_(m), was_training_(m.is_training()) {
    m_.eval();
    if (inference)
      inference_.emplace(true);
    else
      no_grad_.emplace(false);
  }
  ~EvalMode() {
    inference_.reset();
    no_grad_.reset();
    m_.train(was_training_);
  }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  torch::nn::Module& m_;
  bool was_training_;
  std::optional<c10::InferenceMode> inference_;
  std::optional<c10::AutoGradMode> no_grad_;
};

}  // namespace fulgur
