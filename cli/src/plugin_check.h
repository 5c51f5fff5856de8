// `fulgur plugins check`: loads and creates plugins in child processes, so that a plugin that
// crashes, aborts or hangs is reported (and recorded) while this process lives on.
#pragma once

#include <fulgur/registry/registry.h>

#include <optional>
#include <string>

namespace fulgur::cli {

// The hidden subcommand each child runs: fulgur __plugin-check-child FILE KIND NAME.
inline constexpr const char* kCheckChildCommand = "__plugin-check-child";

struct CheckRequest {
  std::optional<std::string> name;  // nullopt: every plugin (--all)
  std::optional<PluginKind> kind;
  double timeout_s = 30.0;
  bool force = false;  // ignore cached verdicts of unchanged files
};

// Runs the checks and prints one line per plugin; returns the exit status (0: every plugin ok).
int check_plugins(const PluginRegistry& registry, const CheckRequest& request);

// The child side; returns its exit status. Reports progress on file descriptor 3.
int check_child_main(int argc, char** argv);

}  // namespace fulgur::cli
