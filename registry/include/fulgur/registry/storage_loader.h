// Object storage (fulgur/storage.h) reached through the plugin search path: the first URL of a
// scheme creates the storage plugin of that name (kind storage, SDK 1.5), or loads a pre-1.5
// library libfulgur-storage-<scheme>.so, which registers the scheme itself. Used by the Trainer
// (`fulgur fit`) and by the CLI's checkpoint and weights commands alike.
#pragma once

#include <fulgur/options.h>
#include <fulgur/registry/registry.h>

#include <optional>
#include <string>
#include <vector>

namespace fulgur {

// The storage plugin a config's [storage] table names, with its options (validated against the
// plugin's schema, defaults applied).
struct ConfiguredStorage {
  std::string name;  // the plugin, which is the URL scheme it serves
  Options options;
};

// Installs the SDK's storage loader over `search_path`. On the first URL of a scheme: the storage
// plugin named after it, created with `configured`'s options when that names it and with the
// schema's defaults otherwise; without such a plugin, the first libfulgur-storage-<scheme>.so on
// the path. A library writable by everyone is refused unless `allow_writable`. Throws
// fulgur::Error naming the scheme, what was looked for and the storage plugins that exist.
// With `configured`, its plugin is created now, so that bad options fail before any training.
void install_storage_loader(const std::vector<SearchDirectory>& search_path, bool allow_writable,
                            const std::optional<ConfiguredStorage>& configured = std::nullopt);

}  // namespace fulgur
