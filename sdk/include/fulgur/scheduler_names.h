/// @file
/// SchedulerNames: an extension (SDK 1.3) of TrainerContext through which callbacks read the names
/// the model gave its learning-rate schedulers (Lightning's lr_scheduler_config["name"], which its
/// LearningRateMonitor logs under). The host's TrainerContext offers it:
///
///   if (auto* names = fulgur::find_extension<fulgur::SchedulerNames>(trainer)) ...
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// The names of the configured learning-rate schedulers, one per optimizer.
class SchedulerNames {
 public:
  /// The extension's id (fulgur/extension.h).
  static constexpr std::string_view kExtensionId = "fulgur.trainer_context.scheduler_names/1";
  /// One entry per TrainerContext::optimizers() entry, in that order: the name given to the
  /// scheduler of that optimizer, or "" when it has no scheduler or an unnamed one.
  virtual std::vector<std::string> scheduler_names() const = 0;

 protected:
  ~SchedulerNames() = default;
};

}  // namespace fulgur
