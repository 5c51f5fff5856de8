// Helpers shared by the monitoring callbacks that write straight to the loggers (lr_monitor,
// throughput_monitor, device_stats), as Lightning's do. Header-only, like callback_conventions.h.
// When a value is due and which step it is written under are the Trainer's to decide
// (TrainerContext::step_logging_due, TrainerContext::log_metrics), so they never drift from its rows.
#pragma once

#include <fulgur/error.h>
#include <fulgur/trainer_context.h>

#include <fmt/format.h>

#include <string_view>

namespace fulgur::direct_logging {

// Lightning refuses these callbacks without a logger: they would compute values nobody sees.
inline void require_logger(TrainerContext& trainer, std::string_view owner) {
  if (!trainer.has_logger())
    throw Error(ErrorKind::config,
                fmt::format("{}: the Trainer has no logger, so there is nowhere to write its values; add a "
                            "[[loggers]] table (e.g. name = \"csv\" or \"tensorboard\") or remove the callback",
                            owner));
}

}  // namespace fulgur::direct_logging
