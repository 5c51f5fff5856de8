// Shared by built-in plugins that write files (loggers, profilers): a directory that cannot be
// written fails at setup, before any training step, instead of losing output mid-run.
#pragma once

#include <fulgur/error.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace fulgur::filesystem_checks {

// Creates `dir` and proves it writable with a probe file. `what` names the directory in the
// message ("the log directory"), `option` the plugin option that moves it ("save_dir").
inline void ensure_writable_directory(std::string_view owner, const std::string& dir, std::string_view what,
                                      std::string_view option) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error)
    throw Error(ErrorKind::io, fmt::format("{}: cannot create {} '{}': {}; set {} to a directory you can write, or "
                                           "fix its permissions",
                                           owner, what, dir, error.message(), option));
  const std::string probe = fmt::format("{}/.write-test-{}", dir, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    throw Error(ErrorKind::io, fmt::format("{}: {} '{}' is not writable: {}; set {} to a directory you can write, or "
                                           "fix its permissions",
                                           owner, what, dir, std::strerror(errno), option));
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace fulgur::filesystem_checks
