#include "step_capture.h"

#include <fulgur/error.h>
#include <fulgur/precision.h>
#include <fulgur/strategy.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/optim/optimizer.h>

#include "../trainer_engine.h"
#include "device_step.h"
#include "fused_adam_step.h"

namespace fulgur {

namespace {

// Callback hooks that run inside a step: a replay would skip them.
constexpr Hook kInStepHooks[] = {Hook::before_zero_grad, Hook::before_backward, Hook::after_backward,
                                 Hook::before_optimizer_step};

std::string shape_text(const at::Tensor& t) {
  return t.defined() ? fmt::format("{} {}", c10::toString(t.scalar_type()), c10::str(t.sizes())) : "none";
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || (a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.device() == b.device());
}

at::Tensor static_copy(const at::Tensor& t) { return t.defined() ? t.clone() : t; }

// The cause of a failed capture in one line: a torch error without its C++ backtrace, and only
// its first line (CUDA errors append advice such as CUDA_LAUNCH_BLOCKING).
std::string reason_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
  return text.substr(0, text.find('\n'));
}

}  // namespace

StepCapture::StepCapture(TrainerEngine& trainer) : t_(trainer), mode_(trainer.trainer_config_.cuda_graphs) {}
StepCapture::~StepCapture() = default;

FusedAdamStep& StepCapture::adam() { return *t_.fused_adam_; }

void StepCapture::prepare() {
  active_ = false;
  warned_ = false;
  graph_.reset();
  warmups_done_ = 0;
  captured_ = false;
  static_batch_ = {};
  static_output_ = {};
  recorded_logs_.clear();
  if (mode_ == StepCaptureMode::off) return;

  const ResolvedTrainerConfig& s = t_.trainer_config_;
  std::string why;
  if (!t_.module_->automatic_optimization)
    why = "manual optimization steps its optimizers from training_step; only automatic optimization is captured";
  else if (s.accumulate_grad_batches > 1)
    why = fmt::format("accumulate_grad_batches = {} alternates steps with and without an optimizer step; use 1",
                      s.accumulate_grad_batches);
  else if (s.detect_anomaly)
    why = "detect_anomaly checks every backward on the host";
  else if (t_.optimizer_ptrs_.size() != 1)
    why = fmt::format("configure_optimizers returned {} optimizers; a captured step steps exactly one",
                      t_.optimizer_ptrs_.size());
  else if (std::string r = FusedAdamStep::refusal(*t_.optimizer_ptrs_.front()); !r.empty())
    why = r;
  else if (std::string r = strategy_capture_refusal(t_.plugins_); !r.empty())
    why = r;
  else if (std::string r = precision_capture_refusal(t_.plugins_); !r.empty())
    why = r;
  if (why.empty())
    for (const auto& slot : t_.hooks_.slots())
      for (Hook hook : kInStepHooks)
        if (why.empty() && has_hook(slot.hooks, hook))
          why = fmt::format("{} '{}' implements {}, which runs inside the step and would not run at a replay",
                            slot.identity.kind, slot.identity.name, hook_name(hook));
  if (why.empty()) {
    if (t_.plugins_.step_graphs) graph_ = t_.plugins_.step_graphs->make_step_graph(t_.device());
    if (!graph_)
      why = fmt::format("the accelerator of device {} cannot capture steps; use accelerator = \"cuda\"",
                        t_.device().str());
  }
  active_ = true;  // refuse() turns it off again under "try"
  if (!why.empty()) refuse(why, /*give_up=*/true);
  if (active_) {
    if (!t_.fused_adam_) t_.fused_adam_ = std::make_unique<FusedAdamStep>(*t_.optimizer_ptrs_.front());
    spdlog::info("cuda_graphs = \"{}\": the training step is captured after {} warm-up steps and replayed",
                 mode_ == StepCaptureMode::on ? "on" : "try", kWarmupSteps);
  }
}

void StepCapture::refuse(const std::string& reason, bool give_up) {
  if (mode_ == StepCaptureMode::on)
    throw Error(ErrorKind::config,
                fmt::format("cuda_graphs = \"on\": the training step cannot be captured: {}. Set cuda_graphs = "
                            "\"try\" to train such steps uncaptured, or \"off\"",
                            reason));
  if (!warned_)
    spdlog::warn("cuda_graphs = \"try\": {}: {}", give_up ? "training uncaptured" : "this batch trains uncaptured",
                 reason);
  warned_ = warned_ || !give_up;  // a batch of another shape warns once; giving up always says so
  if (give_up) {
    active_ = false;
    graph_.reset();
  }
}

std::string StepCapture::shape_mismatch(const Batch& batch, const Batch& reference) {
  auto differs = [&](const char* what, const at::Tensor& now, const at::Tensor& then) -> std::string {
    if (same_layout(now, then)) return {};
    return fmt::format(
        "batch {} is {}, but the captured step was recorded for {} (shapes must stay the same; "
        "drop_last = true in the data loader keeps the last batch from being smaller)",
        what, shape_text(now), shape_text(then));
  };
  if (auto why = differs("input", batch.input, reference.input); !why.empty()) return why;
  if (auto why = differs("target", batch.target, reference.target); !why.empty()) return why;
  if (batch.extra.size() != reference.extra.size())
    return fmt::format("the batch has {} extra tensors, the captured step {}", batch.extra.size(),
                       reference.extra.size());
  for (size_t i = 0; i < batch.extra.size(); ++i)
    if (auto why = differs(fmt::format("extra[{}]", i).c_str(), batch.extra[i], reference.extra[i]); !why.empty())
      return why;
  return {};
}

void StepCapture::copy_into_static(const Batch& batch) {
  if (batch.input.defined()) static_batch_.input.copy_(batch.input, /*non_blocking=*/true);
  if (batch.target.defined()) static_batch_.target.copy_(batch.target, /*non_blocking=*/true);
  for (size_t i = 0; i < batch.extra.size(); ++i)
    if (batch.extra[i].defined()) static_batch_.extra[i].copy_(batch.extra[i], /*non_blocking=*/true);
}

// The step as the Trainer's ordinary path runs it (training_step under the precision's context,
// zero_grad, backward through strategy and precision, unscale and clipping, the Module's hooks),
// except that the optimizer is stepped by FusedAdamStep.
StepOutput StepCapture::eager_step(Batch& batch, int64_t batch_idx, bool grads_to_none) {
  Module& module = *t_.module_;
  Strategy& strategy = *t_.plugins_.strategy;
  Precision& precision = *t_.plugins_.precision;
  torch::optim::Optimizer& optimizer = *t_.optimizer_ptrs_.front();
  StepOutput output;
  {
    PrecisionScope scope(precision);
    output = module.training_step(batch, batch_idx);
  }
  if (!output.loss.defined())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("cuda_graphs: training_step returned no loss at batch {}; a captured step runs backward "
                            "and the optimizer every batch",
                            batch_idx));
  t_.hooks_.module("on_before_zero_grad", [&] { module.on_before_zero_grad(optimizer); });
  // Set to none before the capture, so that backward allocates the gradients the graph then
  // keeps; zeroed in place afterwards, so that uncaptured steps write the same tensors.
  optimizer.zero_grad(grads_to_none);
  t_.hooks_.module("on_before_backward", [&] { module.on_before_backward(output.loss); });
  strategy.backward(output.loss, precision, /*sync_gradients=*/true);
  t_.hooks_.module("on_after_backward", [&] { module.on_after_backward(); });
  precision.unscale_gradients(optimizer);
  t_.hooks_.module("on_before_optimizer_step", [&] { module.on_before_optimizer_step(optimizer); });
  if (t_.trainer_config_.gradient_clip_val > 0)
    strategy.clip_gradients(optimizer, precision, t_.trainer_config_.gradient_clip_val,
                            t_.trainer_config_.gradient_clip_algorithm);
  // 16-mixed: the step is skipped on the device where the gradients were not finite, and the
  // loss scale updated there (inside the recording, so every replay does both).
  adam().step_decided_by(t_.plugins_.precision_device_step, device_found_inf(t_.plugins_, optimizer));
  return output;
}

void StepCapture::log_recorded() {
  MetricStore* store = t_.binding_.metrics;
  if (!store) return;
  for (const RecordedLog& r : recorded_logs_)
    store->log(r.name, r.value.clone(), r.options, t_.binding_.training_context, t_.binding_.batch_size,
               t_.binding_.strategy);
}

// What the hooks after the step see: copies, since the graph's own output tensors are rewritten
// by the next replay (a callback may keep them).
StepOutput StepCapture::output_copy() const {
  StepOutput out;
  if (static_output_.loss.defined()) out.loss = static_output_.loss.detach().clone();
  for (const auto& [name, value] : static_output_.extra) out.extra[name] = value.defined() ? value.clone() : value;
  return out;
}

std::optional<StepOutput> StepCapture::run(Batch& batch, int64_t batch_idx) {
  if (!active_) return std::nullopt;
  // The optimizer's state as resumed, as left by a batch-size trial or replaced by a callback;
  // the hyperparameters as recorded; the lr as the schedulers left it.
  adam().before_step(/*recorded=*/true);

  // Warm-up, and no capture on the epoch's last batch or on a batch shaped unlike the one before
  // it: the recording must be of the shape most batches have (a smaller last batch would make
  // every full one mismatch).
  const bool shaped_like_last = previous_batch_.input.defined() && shape_mismatch(batch, previous_batch_).empty();
  if (!captured_ && (warmups_done_ < kWarmupSteps || !shaped_like_last || t_.is_last_batch())) {
    StepOutput output;
    graph_->warm_up([&] { output = eager_step(batch, batch_idx, /*grads_to_none=*/true); });
    adam().advance_host_steps(/*replayed=*/false);
    ++warmups_done_;
    previous_batch_ = batch;  // (the same tensors: kept only until the capture)
    return output;
  }

  if (!captured_) {
    static_batch_.input = static_copy(batch.input);
    static_batch_.target = static_copy(batch.target);
    static_batch_.extra.clear();
    for (const auto& t : batch.extra) static_batch_.extra.push_back(static_copy(t));
    try {
      graph_->capture([&] {
        recorded_logs_.clear();
        t_.binding_.recorded_logs = &recorded_logs_;
        t_.binding_.recording_device = t_.device();
        // Autocast's cast cache would keep casts made inside the recording past it: every use casts
        // anew while capturing (as torch.cuda.make_graphed_callables requires).
        struct Restore {
          Module::Binding& b;
          bool cache = at::autocast::is_autocast_cache_enabled();
          ~Restore() {
            b.recorded_logs = nullptr;
            at::autocast::set_autocast_cache_enabled(cache);
          }
        } restore{t_.binding_};
        at::autocast::set_autocast_cache_enabled(false);
        static_output_ = eager_step(static_batch_, batch_idx, /*grads_to_none=*/true);
        adam().remember_captured_step();
      });
    } catch (const std::exception& e) {
      // The recorded step never ran: the precision forgets its unscale (the next step unscales
      // its own gradients), and nothing else of it happened. (A step that failed before its
      // optimizer step leaves the unscale behind too.)
      if (auto* device_step = t_.plugins_.precision_device_step)
        device_step->update_after_device_step(*t_.optimizer_ptrs_.front(), at::Tensor());
      t_.binding_.recorded_logs = nullptr;
      recorded_logs_.clear();
      static_batch_ = {};
      static_output_ = {};
      refuse(reason_of(e), /*give_up=*/true);
      // Nothing of the failed capture ran: this batch takes the ordinary path, whose optimizer
      // step continues from the state the warm-ups left (the host step counts, or under 16-mixed
      // the device's, which the ordinary path then also steps).
      return std::nullopt;
    }
    captured_ = true;
    previous_batch_ = {};
    graph_->replay();
    adam().advance_host_steps(/*replayed=*/true);
    spdlog::debug("cuda_graphs: the training step was captured at batch {} ({} logged values replayed per step)",
                  batch_idx, recorded_logs_.size());
    log_recorded();
    return output_copy();
  }
  if (const std::string why = shape_mismatch(batch, static_batch_); !why.empty()) {
    refuse(why, /*give_up=*/false);
    StepOutput output = eager_step(batch, batch_idx, /*grads_to_none=*/false);
    adam().advance_host_steps(/*replayed=*/false);
    return output;
  }
  copy_into_static(batch);
  graph_->replay();
  adam().advance_host_steps(/*replayed=*/true);
  log_recorded();
  return output_copy();
}

}  // namespace fulgur
