// Fuzz target: the plugin ELF-note reader over an arbitrary file image (it never throws; the
// result is a status and a detail text).
#include <fulgur/registry/metadata.h>

#include "fuzz_targets.h"

namespace fulgur::fuzz {

int elf_note(const uint8_t* data, size_t size) {
  NoteReadResult result = read_plugin_notes(data, size);
  // Touch what a caller would read.
  size_t total = result.detail.size();
  for (const PluginMetadata& m : result.plugins) total += m.name.size() + m.options.size();
  return total == static_cast<size_t>(-1) ? 1 : 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::elf_note)
