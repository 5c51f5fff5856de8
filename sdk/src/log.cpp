// The SDK's logging facade: plugins write through the host's spdlog default logger, which the
// Trainer configures (level, rank-zero filtering).
#include <fulgur/log.h>

#include <spdlog/spdlog.h>

namespace fulgur::log {

namespace {
spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::trace:
      return spdlog::level::trace;
    case Level::debug:
      return spdlog::level::debug;
    case Level::info:
      return spdlog::level::info;
    case Level::warn:
      return spdlog::level::warn;
    case Level::error:
      return spdlog::level::err;
  }
  return spdlog::level::info;
}
}  // namespace

void write(Level level, std::string_view message) { spdlog::log(to_spdlog(level), "{}", message); }
bool enabled(Level level) { return spdlog::should_log(to_spdlog(level)); }

}  // namespace fulgur::log
