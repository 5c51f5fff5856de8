// Plugin metadata as read from a library's ELF note, without loading the library.
#pragma once

#include <fulgur/abi.h>
#include <fulgur/options.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

enum class PluginKind : uint32_t {
  accelerator = FULGUR_KIND_ACCELERATOR,
  strategy = FULGUR_KIND_STRATEGY,
  precision = FULGUR_KIND_PRECISION,
  logger = FULGUR_KIND_LOGGER,
  profiler = FULGUR_KIND_PROFILER,
  callback = FULGUR_KIND_CALLBACK,
  model = FULGUR_KIND_MODEL,
  datamodule = FULGUR_KIND_DATAMODULE,
  storage = FULGUR_KIND_STORAGE,
};

std::string_view to_string(PluginKind kind);
std::optional<PluginKind> parse_plugin_kind(std::string_view text);
bool is_valid_plugin_kind(uint32_t kind);

struct OptionSchema {
  std::string key;
  OptionType type = OptionType::string;
  std::string default_text;                  // TOML value text, empty when required
  std::optional<OptionValue> default_value;  // parsed; nullopt = required
  std::string help;
};

struct PluginMetadata {
  PluginKind kind = PluginKind::callback;
  std::string name;
  std::string version;
  std::string description;
  uint32_t abi_major = 0;
  uint32_t abi_minor = 0;
  fulgur_abi_tag abi_tag{};
  std::vector<OptionSchema> options;
  uint64_t note_hash = 0;  // FNV-1a of the note payload: identifies this metadata in verdict caches

  const OptionSchema* find_option(std::string_view key) const;
};

// What reading a file's notes found.
struct NoteReadResult {
  enum class Status {
    plugin,      // one or more Fulgur notes
    not_elf,     // not an ELF file at all
    not_plugin,  // ELF without a Fulgur note
    wrong_arch,  // ELF for another class/endianness/machine
    corrupt,     // truncated or inconsistent headers or note
  };
  Status status = Status::not_elf;
  std::string detail;  // for wrong_arch / corrupt: what exactly
  std::vector<PluginMetadata> plugins;
};

// Reads every Fulgur note from the PT_NOTE segments of `file`. Never runs code from the file.
// Also refuses (corrupt) a file whose program headers, segments, section header table or sections
// reach beyond its end, such as a truncated copy whose note survived.
NoteReadResult read_plugin_notes(const std::filesystem::path& file);
// The same, over bytes already in memory (the fuzz target).
NoteReadResult read_plugin_notes(const void* data, size_t size);

// Parses a schema default (TOML value text) into a value of `type`; nullopt if it does not fit.
std::optional<OptionValue> parse_option_default(OptionType type, std::string_view toml_text);

}  // namespace fulgur
