/// @file
/// The one exception family for everything a user can cause: bad TOML, a missing or incompatible
/// plugin, a corrupt checkpoint, a dead rank. The message says what, where and how to fix it.
#pragma once

#include <fulgur/export.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace fulgur {

/// What kind of problem a fulgur::Error reports (the message carries the details).
enum class ErrorKind {
  config,            ///< TOML syntax, unknown key, wrong type, bad value
  plugin_not_found,  ///< no plugin of that kind and name on the search path
  plugin_rejected,   ///< metadata phase: ABI, torch tag, architecture, permissions, reserved name
  plugin_load,       ///< dlopen failed, entry point missing, descriptor inconsistent
  plugin_create,     ///< the factory reported an error
  plugin_ambiguous,  ///< two plugins of the same kind and name in one directory, and it was selected
  checkpoint,        ///< a checkpoint is missing, corrupt, foreign or does not fit the model
  io,                ///< the operating system refused a read or write (with its reason)
  distributed,       ///< rendezvous, a collective or a peer rank failed
  invalid_argument,  ///< an API was called with a value it cannot accept
  runtime,           ///< anything else, e.g. a plugin's own failure wrapped with where it happened
};

/// The kind's name as spelled in the enum ("plugin_not_found"); "unknown" for other values.
FULGUR_SDK_API std::string_view to_string(ErrorKind kind);

/// The exception Fulgur throws for everything a user can cause. Plugins throw it too, from their
/// constructors and interface methods (never across the C door: FULGUR_PLUGIN's factory catches
/// it and reports the message). What a callback, logger or Module hook throws reaches the caller of
/// fit/validate/test/predict as an Error of the same kind (ErrorKind::runtime for other exceptions)
/// whose message also names the plugin, the hook, and the epoch and global step it was raised at.
class FULGUR_SDK_API Error : public std::runtime_error {
 public:
  /// `message` is the whole text what() returns: say what failed, where, and how to fix it.
  Error(ErrorKind kind, const std::string& message);
  ~Error() override;  // out of line: the key function keeps one typeinfo, in the SDK library
  /// What kind of problem this is.
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace fulgur
