// Object storage (fulgur/storage.h) reached through the plugin search path: the first URL of a
// scheme loads libfulgur-storage-<scheme>.so, which registers that scheme. Used by the Trainer
// (`fulgur fit`) and by the CLI's checkpoint and weights commands alike.
#pragma once

#include <fulgur/registry/registry.h>

#include <vector>

namespace fulgur {

/// Installs the SDK's storage loader over `search_path`: the first directory holding
/// libfulgur-storage-<scheme>.so wins. A library writable by everyone is refused unless
/// `allow_writable`; one that cannot be loaded throws fulgur::Error(plugin_rejected) naming it.
void install_storage_loader(const std::vector<SearchDirectory>& search_path, bool allow_writable);

}  // namespace fulgur
