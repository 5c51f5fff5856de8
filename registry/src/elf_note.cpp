// Reads Fulgur's metadata note from a plugin file. Qt's lesson: walk PT_NOTE program headers
// (what the loader sees) rather than section headers, so stripping and section shuffling by
// packaging tools cannot hide the note. Nothing from the file is ever executed.
#include <fulgur/registry/metadata.h>

#include <elf.h>
#include <fmt/format.h>

#include <cstring>
#include <fstream>

namespace fulgur {

namespace {

constexpr size_t kMaxNoteSegment = 1 << 20;  // our notes are a few KiB; refuse absurd sizes

const char* machine_name(uint16_t machine) {
  switch (machine) {
    case EM_X86_64:
      return "x86-64";
    case EM_386:
      return "i386";
    case EM_AARCH64:
      return "aarch64";
    case EM_ARM:
      return "arm";
    case EM_PPC64:
      return "ppc64";
    case EM_RISCV:
      return "riscv";
    case EM_S390:
      return "s390";
    default:
      return "unknown";
  }
}

#if defined(__x86_64__)
constexpr uint16_t kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr uint16_t kHostMachine = EM_AARCH64;
#elif defined(__powerpc64__)
constexpr uint16_t kHostMachine = EM_PPC64;
#else
#error "unsupported host architecture"
#endif

struct Cursor {
  const char* data;
  size_t size;
  size_t pos = 0;

  bool take_cstr(std::string& out) {
    const void* end = std::memchr(data + pos, '\0', size - pos);
    if (pos >= size || end == nullptr) return false;
    out.assign(data + pos, static_cast<const char*>(end));
    pos = static_cast<size_t>(static_cast<const char*>(end) - data) + 1;
    return true;
  }
};

// Parses one note desc; returns an error text or empty on success.
std::string parse_payload(const char* desc, size_t size, PluginMetadata& out) {
  fulgur_note_header header{};
  constexpr size_t kMinHeader = FULGUR_STRUCT_SIZE(fulgur_note_header, strings_size);
  if (size < kMinHeader) return fmt::format("note payload of {} bytes is shorter than its header", size);
  std::memcpy(&header, desc, std::min(size, sizeof(header)));
  if (header.struct_size < kMinHeader || header.struct_size > size)
    return fmt::format("note header declares size {}, payload has {}", header.struct_size, size);
  if (header.option_count > 1024) return fmt::format("note declares {} options", header.option_count);
  const size_t types_at = header.struct_size;
  const size_t strings_at = types_at + sizeof(uint32_t) * std::max<size_t>(header.option_count, 1);
  if (strings_at + header.strings_size > size)
    return fmt::format("note strings ({} bytes) run past the payload ({} bytes)", header.strings_size, size);

  out.abi_major = header.abi_major;
  out.abi_minor = header.abi_minor;
  out.kind = static_cast<PluginKind>(header.kind);
  // Copy only the tag fields this host knows; a newer, longer tag keeps its prefix layout.
  std::memcpy(&out.abi_tag, &header.abi_tag, std::min<size_t>(sizeof(out.abi_tag), header.abi_tag.struct_size));

  Cursor strings{desc + strings_at, header.strings_size};
  if (!strings.take_cstr(out.name) || !strings.take_cstr(out.version) || !strings.take_cstr(out.description))
    return "note strings are truncated (name, version, description)";
  for (uint32_t i = 0; i < header.option_count; ++i) {
    OptionSchema option;
    uint32_t type = 0;
    std::memcpy(&type, desc + types_at + sizeof(uint32_t) * i, sizeof(type));
    if (type < FULGUR_OPTION_BOOL || type > FULGUR_OPTION_FLOAT_LIST)
      return fmt::format("option #{} has unknown type code {}", i, type);
    option.type = static_cast<OptionType>(type);
    if (!strings.take_cstr(option.key) || !strings.take_cstr(option.default_text) || !strings.take_cstr(option.help))
      return fmt::format("note strings are truncated in option #{}", i);
    if (option.default_text == "\x01") {
      option.default_text.clear();
    } else {
      option.default_value = parse_option_default(option.type, option.default_text);
      if (!option.default_value)
        return fmt::format("option '{}' declares default {} which is not a valid {}", option.key, option.default_text,
                           to_string(option.type));
    }
    out.options.push_back(std::move(option));
  }
  return {};
}

}  // namespace

NoteReadResult read_plugin_notes(const std::filesystem::path& file) {
  NoteReadResult result;
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    result.status = NoteReadResult::Status::corrupt;
    result.detail = "cannot be opened for reading";
    return result;
  }
  unsigned char ident[EI_NIDENT] = {};
  in.read(reinterpret_cast<char*>(ident), EI_NIDENT);
  if (in.gcount() != EI_NIDENT || std::memcmp(ident, ELFMAG, SELFMAG) != 0) {
    result.status = NoteReadResult::Status::not_elf;
    return result;
  }
  if (ident[EI_CLASS] != ELFCLASS64 || ident[EI_DATA] != ELFDATA2LSB) {
    result.status = NoteReadResult::Status::wrong_arch;
    result.detail = fmt::format("file is {} {}-endian ELF, host is 64-bit little-endian",
                                ident[EI_CLASS] == ELFCLASS32 ? "32-bit" : "unknown-class",
                                ident[EI_DATA] == ELFDATA2MSB ? "big" : "little");
    return result;
  }
  Elf64_Ehdr eh{};
  in.seekg(0);
  in.read(reinterpret_cast<char*>(&eh), sizeof(eh));
  if (in.gcount() != static_cast<std::streamsize>(sizeof(eh))) {
    result.status = NoteReadResult::Status::corrupt;
    result.detail = "ELF header is truncated";
    return result;
  }
  if (eh.e_machine != kHostMachine) {
    result.status = NoteReadResult::Status::wrong_arch;
    result.detail = fmt::format("file is built for {} (e_machine {}), host is {}", machine_name(eh.e_machine),
                                eh.e_machine, machine_name(kHostMachine));
    return result;
  }
  if (eh.e_type != ET_DYN) {
    result.status = NoteReadResult::Status::not_plugin;
    result.detail = "not a shared library";
    return result;
  }
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 || eh.e_phnum > 4096) {
    result.status = NoteReadResult::Status::corrupt;
    result.detail = "program header table is missing or malformed";
    return result;
  }
  std::vector<Elf64_Phdr> phdrs(eh.e_phnum);
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  in.read(reinterpret_cast<char*>(phdrs.data()), static_cast<std::streamsize>(sizeof(Elf64_Phdr) * eh.e_phnum));
  if (!in) {
    result.status = NoteReadResult::Status::corrupt;
    result.detail = "program header table runs past the end of the file";
    return result;
  }

  for (const Elf64_Phdr& ph : phdrs) {
    if (ph.p_type != PT_NOTE) continue;
    if (ph.p_filesz > kMaxNoteSegment) continue;
    std::vector<char> seg(ph.p_filesz);
    in.seekg(static_cast<std::streamoff>(ph.p_offset));
    in.read(seg.data(), static_cast<std::streamsize>(seg.size()));
    if (!in) {
      result.status = NoteReadResult::Status::corrupt;
      result.detail = "note segment runs past the end of the file";
      result.plugins.clear();
      return result;
    }
    const size_t align = ph.p_align == 8 ? 8 : 4;
    auto pad = [align](size_t n) { return (n + align - 1) / align * align; };
    size_t pos = 0;
    while (pos + sizeof(Elf64_Nhdr) <= seg.size()) {
      Elf64_Nhdr nh{};
      std::memcpy(&nh, seg.data() + pos, sizeof(nh));
      const size_t name_at = pos + sizeof(nh);
      const size_t desc_at = name_at + pad(nh.n_namesz);
      if (desc_at > seg.size() || nh.n_descsz > seg.size() - desc_at) break;  // not ours to judge
      const bool ours = nh.n_type == FULGUR_NOTE_TYPE && nh.n_namesz == sizeof(FULGUR_NOTE_OWNER) &&
                        std::memcmp(seg.data() + name_at, FULGUR_NOTE_OWNER, sizeof(FULGUR_NOTE_OWNER)) == 0;
      if (ours) {
        PluginMetadata meta;
        std::string error = parse_payload(seg.data() + desc_at, nh.n_descsz, meta);
        if (!error.empty()) {
          result.status = NoteReadResult::Status::corrupt;
          result.detail = "corrupt Fulgur metadata note: " + error;
          result.plugins.clear();
          return result;
        }
        result.plugins.push_back(std::move(meta));
      }
      pos = desc_at + pad(nh.n_descsz);
    }
  }
  result.status = result.plugins.empty() ? NoteReadResult::Status::not_plugin : NoteReadResult::Status::plugin;
  return result;
}

const OptionSchema* PluginMetadata::find_option(std::string_view key) const {
  for (const auto& option : options)
    if (option.key == key) return &option;
  return nullptr;
}

std::string_view to_string(PluginKind kind) {
  switch (kind) {
    case PluginKind::accelerator:
      return "accelerator";
    case PluginKind::strategy:
      return "strategy";
    case PluginKind::precision:
      return "precision";
    case PluginKind::logger:
      return "logger";
    case PluginKind::profiler:
      return "profiler";
    case PluginKind::callback:
      return "callback";
  }
  return "unknown";
}

bool is_valid_plugin_kind(uint32_t kind) { return kind >= FULGUR_KIND_ACCELERATOR && kind <= FULGUR_KIND_CALLBACK; }

std::optional<PluginKind> parse_plugin_kind(std::string_view text) {
  for (uint32_t k = FULGUR_KIND_ACCELERATOR; k <= FULGUR_KIND_CALLBACK; ++k)
    if (to_string(static_cast<PluginKind>(k)) == text) return static_cast<PluginKind>(k);
  return std::nullopt;
}

}  // namespace fulgur
