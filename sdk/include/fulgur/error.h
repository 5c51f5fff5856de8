// The one exception family for everything a user can cause: bad TOML, a missing or incompatible
// plugin, a corrupt checkpoint, a dead rank. The message says what, where and how to fix it.
#pragma once

#include <fulgur/export.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace fulgur {

enum class ErrorKind {
  config,  // TOML syntax, unknown key, wrong type, bad value
  plugin_not_found,
  plugin_rejected,  // metadata phase: ABI, torch tag, architecture, permissions, reserved name
  plugin_load,      // dlopen failed, entry point missing, descriptor inconsistent
  plugin_create,    // the factory reported an error
  plugin_ambiguous,
  checkpoint,
  io,
  distributed,
  invalid_argument,
  runtime,
};

FULGUR_SDK_API std::string_view to_string(ErrorKind kind);

class FULGUR_SDK_API Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message);
  ~Error() override;  // out of line: the key function keeps one typeinfo, in the SDK library
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace fulgur
