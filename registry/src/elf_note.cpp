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
    if (type < FULGUR_OPTION_BOOL || type > FULGUR_OPTION_PATH)
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

namespace {

// Where the bytes come from: the file itself (discovery reads a few KiB of a large library) or a
// buffer (the fuzz target). Reads are bounds-checked against size(); a failed read means the
// requested range is not in the file.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  virtual bool read(uint64_t offset, void* out, size_t n) = 0;
};

class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::filesystem::path& file) : in_(file, std::ios::binary) {
    if (in_) {
      in_.seekg(0, std::ios::end);
      const std::streamoff end = in_.tellg();
      size_ = end > 0 ? static_cast<uint64_t>(end) : 0;
      in_.seekg(0);
    }
  }
  bool ok() const { return static_cast<bool>(in_); }
  uint64_t size() const override { return size_; }
  bool read(uint64_t offset, void* out, size_t n) override {
    if (offset > size_ || n > size_ - offset) return false;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(offset));
    in_.read(static_cast<char*>(out), static_cast<std::streamsize>(n));
    return in_.gcount() == static_cast<std::streamsize>(n);
  }

 private:
  std::ifstream in_;
  uint64_t size_ = 0;
};

class MemorySource final : public ByteSource {
 public:
  MemorySource(const void* data, size_t size) : data_(static_cast<const char*>(data)), size_(size) {}
  uint64_t size() const override { return size_; }
  bool read(uint64_t offset, void* out, size_t n) override {
    if (offset > size_ || n > size_ - offset) return false;
    if (n) std::memcpy(out, data_ + offset, n);
    return true;
  }

 private:
  const char* data_;
  uint64_t size_;
};

// FNV-1a over the note payload: identifies "the same metadata" in the plugin verdict cache.
uint64_t fnv1a(const char* data, size_t size) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < size; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Whether [offset, offset + size) lies inside a file of `file_size` bytes, without overflow.
bool within(uint64_t offset, uint64_t size, uint64_t file_size) {
  return offset <= file_size && size <= file_size - offset;
}

NoteReadResult corrupt(std::string detail) {
  NoteReadResult result;
  result.status = NoteReadResult::Status::corrupt;
  result.detail = std::move(detail);
  return result;
}

const char* segment_type_name(uint32_t type) {
  switch (type) {
    case PT_LOAD:
      return "PT_LOAD";
    case PT_DYNAMIC:
      return "PT_DYNAMIC";
    case PT_NOTE:
      return "PT_NOTE";
    case PT_GNU_EH_FRAME:
      return "PT_GNU_EH_FRAME";
    default:
      return "segment";
  }
}

// The loader maps segments and tools read sections by offset: every one of them must lie inside
// the file. A truncated copy (an interrupted download or install) keeps its first pages, notes
// included, and would otherwise pass as a plugin.
std::string extent_problem(ByteSource& src, const Elf64_Ehdr& eh, const std::vector<Elf64_Phdr>& phdrs) {
  const uint64_t file_size = src.size();
  for (size_t i = 0; i < phdrs.size(); ++i) {
    const Elf64_Phdr& ph = phdrs[i];
    if (ph.p_filesz != 0 && !within(ph.p_offset, ph.p_filesz, file_size))
      return fmt::format("program header #{} ({}) covers bytes {}..{} but the file has {} bytes: truncated or damaged",
                         i, segment_type_name(ph.p_type), ph.p_offset, ph.p_offset + ph.p_filesz, file_size);
  }
  if (eh.e_shoff == 0) return {};  // no section headers at all: allowed (sstrip), the loader needs none
  if (eh.e_shentsize != sizeof(Elf64_Shdr)) return "section header table is malformed (entry size)";
  uint64_t count = eh.e_shnum;
  if (!within(eh.e_shoff, sizeof(Elf64_Shdr), file_size))
    return fmt::format(
        "section header table at offset {} lies beyond the end of the file ({} bytes): truncated or "
        "damaged",
        eh.e_shoff, file_size);
  if (count == 0) {  // extended numbering: the count lives in section 0
    Elf64_Shdr first{};
    if (!src.read(eh.e_shoff, &first, sizeof(first))) return "section header table cannot be read";
    count = first.sh_size;
  }
  if (count > (uint64_t{1} << 20)) return fmt::format("section header table declares {} sections", count);
  if (!within(eh.e_shoff, count * sizeof(Elf64_Shdr), file_size))
    return fmt::format(
        "section header table ({} entries at offset {}) runs past the end of the file ({} bytes): "
        "truncated or damaged",
        count, eh.e_shoff, file_size);
  std::vector<Elf64_Shdr> shdrs(count);
  if (!src.read(eh.e_shoff, shdrs.data(), shdrs.size() * sizeof(Elf64_Shdr)))
    return "section header table cannot be read";
  for (size_t i = 0; i < shdrs.size(); ++i) {
    const Elf64_Shdr& sh = shdrs[i];
    if (sh.sh_type == SHT_NOBITS || sh.sh_type == SHT_NULL || sh.sh_size == 0) continue;
    if (!within(sh.sh_offset, sh.sh_size, file_size))
      return fmt::format("section #{} covers bytes {}..{} but the file has {} bytes: truncated or damaged", i,
                         sh.sh_offset, sh.sh_offset + sh.sh_size, file_size);
  }
  return {};
}

NoteReadResult read_notes(ByteSource& src) {
  NoteReadResult result;
  unsigned char ident[EI_NIDENT] = {};
  if (!src.read(0, ident, EI_NIDENT) || std::memcmp(ident, ELFMAG, SELFMAG) != 0) {
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
  if (!src.read(0, &eh, sizeof(eh))) return corrupt("ELF header is truncated");
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
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 || eh.e_phnum > 4096)
    return corrupt("program header table is missing or malformed");
  std::vector<Elf64_Phdr> phdrs(eh.e_phnum);
  if (!within(eh.e_phoff, sizeof(Elf64_Phdr) * eh.e_phnum, src.size()) ||
      !src.read(eh.e_phoff, phdrs.data(), sizeof(Elf64_Phdr) * eh.e_phnum))
    return corrupt(
        fmt::format("program header table runs past the end of the file ({} entries at offset {}, file of {} "
                    "bytes): truncated or damaged",
                    eh.e_phnum, eh.e_phoff, src.size()));

  for (const Elf64_Phdr& ph : phdrs) {
    if (ph.p_type != PT_NOTE) continue;
    if (ph.p_filesz > kMaxNoteSegment) continue;
    std::vector<char> seg(ph.p_filesz);
    if (!src.read(ph.p_offset, seg.data(), seg.size())) return corrupt("note segment runs past the end of the file");
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
        if (!error.empty()) return corrupt("corrupt Fulgur metadata note: " + error);
        meta.note_hash = fnv1a(seg.data() + desc_at, nh.n_descsz);
        result.plugins.push_back(std::move(meta));
      }
      pos = desc_at + pad(nh.n_descsz);
    }
  }
  if (result.plugins.empty()) {
    result.status = NoteReadResult::Status::not_plugin;
    return result;
  }
  // Only a plugin is worth the whole-file consistency check (it is about to be offered for loading).
  if (std::string problem = extent_problem(src, eh, phdrs); !problem.empty()) return corrupt(std::move(problem));
  result.status = NoteReadResult::Status::plugin;
  return result;
}

}  // namespace

NoteReadResult read_plugin_notes(const std::filesystem::path& file) {
  FileSource src(file);
  if (!src.ok()) return corrupt("cannot be opened for reading");
  return read_notes(src);
}

NoteReadResult read_plugin_notes(const void* data, size_t size) {
  MemorySource src(data, size);
  return read_notes(src);
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
    case PluginKind::model:
      return "model";
    case PluginKind::datamodule:
      return "datamodule";
    case PluginKind::storage:
      return "storage";
  }
  return "unknown";
}

bool is_valid_plugin_kind(uint32_t kind) { return kind >= FULGUR_KIND_ACCELERATOR && kind <= FULGUR_KIND_STORAGE; }

std::optional<PluginKind> parse_plugin_kind(std::string_view text) {
  for (uint32_t k = FULGUR_KIND_ACCELERATOR; k <= FULGUR_KIND_STORAGE; ++k)
    if (to_string(static_cast<PluginKind>(k)) == text) return static_cast<PluginKind>(k);
  return std::nullopt;
}

}  // namespace fulgur
