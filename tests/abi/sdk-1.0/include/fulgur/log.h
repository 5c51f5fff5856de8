/// @file
/// Diagnostics for plugins, through the host's logger: the same sink, level and rank-zero rule as
/// Fulgur's own messages ([logging] level, FULGUR_LOG_LEVEL), without linking a logging library.
///
/// @code
///   fulgur::log::info("hello: greeting printed");
///   if (fulgur::log::enabled(fulgur::log::Level::debug)) fulgur::log::debug(expensive_text());
/// @endcode
#pragma once

#include <fulgur/export.h>

#include <string_view>

/// Plugin diagnostics through the host's logger (fulgur/log.h).
namespace fulgur::log {

/// Severity of a message, lowest first. Messages below the host's level are dropped; ranks other
/// than zero show only warn and error unless FULGUR_LOG_LEVEL is set.
enum class Level { trace, debug, info, warn, error };

/// Writes one message (a line; no trailing newline needed) at `level` to the host's sink, or drops
/// it below the current level. Safe to call from any thread.
FULGUR_SDK_API void write(Level level, std::string_view message);
/// Whether a message at `level` would be written now: test it before building expensive text.
FULGUR_SDK_API bool enabled(Level level);

/// write(Level::trace, message).
inline void trace(std::string_view message) { write(Level::trace, message); }
/// write(Level::debug, message).
inline void debug(std::string_view message) { write(Level::debug, message); }
/// write(Level::info, message).
inline void info(std::string_view message) { write(Level::info, message); }
/// write(Level::warn, message).
inline void warn(std::string_view message) { write(Level::warn, message); }
/// write(Level::error, message): a problem worth the user's attention; it does not stop the run
/// (throw fulgur::Error for that).
inline void error(std::string_view message) { write(Level::error, message); }

}  // namespace fulgur::log
