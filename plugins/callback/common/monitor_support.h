// Helpers shared by the monitoring callbacks that write straight to the loggers (lr_monitor,
// throughput_monitor, device_stats), as Lightning's do: when a value is due, the step it is logged
// under, and the error for a run without a logger. Header-only, like callback_support.h.
#pragma once

#include <fulgur/error.h>
#include <fulgur/logger.h>
#include <fulgur/trainer_context.h>

#include <fmt/format.h>

#include <string_view>

namespace fulgur::monitor_support {

// Due at on_train_batch_start of the batch whose step the Trainer logs (log_every_n_steps).
inline bool due_at_batch_start(const TrainerContext& trainer) {
  return (trainer.global_step() + 1) % trainer.log_every_n_steps() == 0 || trainer.should_stop();
}

// Due at on_train_batch_end when the Trainer logs this step's metrics too.
inline bool due_at_batch_end(const TrainerContext& trainer) {
  return trainer.global_step() % trainer.log_every_n_steps() == 0 || trainer.is_last_batch() || trainer.should_stop();
}

// The step the Trainer's own rows for the current batch carry (optimizer steps before it).
inline int64_t step_at_batch_start(const TrainerContext& trainer) { return trainer.global_step(); }
inline int64_t step_at_batch_end(const TrainerContext& trainer) {
  return trainer.global_step() > 0 ? trainer.global_step() - 1 : 0;
}

inline void log_to_loggers(TrainerContext& trainer, const MetricMap& metrics, int64_t step) {
  if (metrics.empty()) return;
  for (Logger* logger : trainer.loggers()) logger->log_metrics(metrics, step);
}

// Lightning refuses these callbacks without a logger: they would compute values nobody sees.
inline void require_logger(TrainerContext& trainer, std::string_view owner) {
  if (trainer.loggers().empty())
    throw Error(ErrorKind::config,
                fmt::format("{}: the Trainer has no logger, so there is nowhere to write its values; add a "
                            "[[loggers]] table (e.g. name = \"csv\" or \"tensorboard\") or remove the callback",
                            owner));
}

}  // namespace fulgur::monitor_support
