// `fulgur weights` and `fulgur checkpoint` on object storage: an s3:// input is downloaded to a
// local temporary copy (a file, or a sharded checkpoint's prefix as a directory) and an s3://
// output is written locally, then uploaded in one atomic write (fulgur/storage.h). The storage
// library is loaded from the plugin search path, as `fulgur fit` loads it.
#pragma once

#include <fulgur/config.h>
#include <fulgur/registry/registry.h>

#include <string>

namespace fulgur::cli {

/// Where `fulgur weights` and `fulgur checkpoint` find their storage plugins, with each plugin's
/// defaults: the plugin search path. Call this or the overload below before the first LocalInput.
void configure_storage();

/// The same from `config` (--config, the TOML `fulgur fit` ran with) and the registry made from it:
/// its plugin directories and its [storage] table, whose plugin is created now (a bad value fails
/// before any download).
void configure_storage(const Config& config, const PluginRegistry& registry);

/// A local path for an input that may be a URL: the path itself, or a temporary copy of the URL's
/// file or sharded checkpoint (its .metadata marks one), removed with this object.
class LocalInput {
 public:
  explicit LocalInput(const std::string& path_or_url);
  ~LocalInput();
  LocalInput(const LocalInput&) = delete;
  LocalInput& operator=(const LocalInput&) = delete;
  const std::string& path() const { return local_; }

 private:
  std::string local_, temporary_;
};

/// A local path to write an output to; publish() uploads it when the output is a URL.
class LocalOutput {
 public:
  explicit LocalOutput(const std::string& path_or_url);
  ~LocalOutput();
  LocalOutput(const LocalOutput&) = delete;
  LocalOutput& operator=(const LocalOutput&) = delete;
  const std::string& path() const { return local_; }
  /// Uploads the local file to the URL (nothing for a local path).
  void publish();

 private:
  std::string target_, local_, temporary_;
};

}  // namespace fulgur::cli
