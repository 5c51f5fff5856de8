#include <fulgur/error.h>

namespace fulgur {

std::string_view to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::config:
      return "config";
    case ErrorKind::plugin_not_found:
      return "plugin_not_found";
    case ErrorKind::plugin_rejected:
      return "plugin_rejected";
    case ErrorKind::plugin_load:
      return "plugin_load";
    case ErrorKind::plugin_create:
      return "plugin_create";
    case ErrorKind::plugin_ambiguous:
      return "plugin_ambiguous";
    case ErrorKind::checkpoint:
      return "checkpoint";
    case ErrorKind::io:
      return "io";
    case ErrorKind::distributed:
      return "distributed";
    case ErrorKind::invalid_argument:
      return "invalid_argument";
    case ErrorKind::runtime:
      return "runtime";
  }
  return "unknown";
}

Error::Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
Error::~Error() = default;

}  // namespace fulgur
