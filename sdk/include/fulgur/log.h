// Diagnostics for plugins, through the host's logger: the same sink, level and rank-zero rule as
// Fulgur's own messages ([logging] level, FULGUR_LOG_LEVEL), without linking a logging library.
//
//   fulgur::log::info("hello: greeting printed");
//   if (fulgur::log::enabled(fulgur::log::Level::debug)) fulgur::log::debug(expensive_text());
#pragma once

#include <fulgur/export.h>

#include <string_view>

namespace fulgur::log {

enum class Level { trace, debug, info, warn, error };

FULGUR_SDK_API void write(Level level, std::string_view message);
FULGUR_SDK_API bool enabled(Level level);

inline void trace(std::string_view message) { write(Level::trace, message); }
inline void debug(std::string_view message) { write(Level::debug, message); }
inline void info(std::string_view message) { write(Level::info, message); }
inline void warn(std::string_view message) { write(Level::warn, message); }
inline void error(std::string_view message) { write(Level::error, message); }

}  // namespace fulgur::log
