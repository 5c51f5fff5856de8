// Out-of-line destructors: the key functions that put each interface's vtable and typeinfo in
// the SDK library once, shared by the host and every plugin.
#include <fulgur/accelerator.h>
#include <fulgur/callback.h>
#include <fulgur/communicator.h>
#include <fulgur/logger.h>
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
Communicator::~Communicator() = default;
PendingCollective::~PendingCollective() = default;
GradientSync::~GradientSync() = default;
TrainerContext::~TrainerContext() = default;

bool TrainerContext::is_global_zero() const { return const_cast<TrainerContext*>(this)->strategy().is_global_zero(); }

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
