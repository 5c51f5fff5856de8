// The safetensors file format: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw bytes. Reading trusts nothing in the file:
// every length and offset is checked against the file before anything is allocated or read.
// Writing reproduces the reference implementation's layout byte for byte.
#include <fulgur/error.h>
#include <fulgur/weights.h>

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fulgur {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so must the host be");

namespace {

// The reference reader refuses larger headers; so do we (and it bounds what a corrupt length makes
// us allocate).
constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct DtypeInfo {
  const char* code;
  c10::ScalarType type;
  uint64_t size;
  int rank;  // position in the reference's Dtype enum: the writer orders tensors by it, widest first
};

// The codes torch has a dtype for, with their rank in safetensors' enum (BOOL=0, F4, F6_E2M3,
// F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64,
// U64=19).
constexpr std::array<DtypeInfo, 17> kDtypes{{
    {"BOOL", c10::ScalarType::Bool, 1, 0},
    {"U8", c10::ScalarType::Byte, 1, 4},
    {"I8", c10::ScalarType::Char, 1, 5},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2, 1, 6},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn, 1, 7},
    {"F8_E8M0", c10::ScalarType::Float8_e8m0fnu, 1, 8},
    {"I16", c10::ScalarType::Short, 2, 9},
    {"U16", c10::ScalarType::UInt16, 2, 10},
    {"F16", c10::ScalarType::Half, 2, 11},
    {"BF16", c10::ScalarType::BFloat16, 2, 12},
    {"I32", c10::ScalarType::Int, 4, 13},
    {"U32", c10::ScalarType::UInt32, 4, 14},
    {"F32", c10::ScalarType::Float, 4, 15},
    {"C64", c10::ScalarType::ComplexFloat, 8, 16},
    {"F64", c10::ScalarType::Double, 8, 17},
    {"I64", c10::ScalarType::Long, 8, 18},
    {"U64", c10::ScalarType::UInt64, 8, 19},
}};

const DtypeInfo* by_code(std::string_view code) {
  for (const auto& d : kDtypes)
    if (code == d.code) return &d;
  return nullptr;
}

const DtypeInfo* by_type(c10::ScalarType type) {
  for (const auto& d : kDtypes)
    if (type == d.type) return &d;
  return nullptr;
}

std::string os_reason(int error_number) { return std::system_category().message(error_number); }

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw Error(ErrorKind::checkpoint, fmt::format("safetensors file '{}' is not valid: {}", path, what));
}

// An open file descriptor, closed at scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

Fd open_for_reading(const std::string& path, uint64_t& size) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0)
    throw Error(ErrorKind::io, fmt::format("cannot open safetensors file '{}': {}", path, os_reason(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode))
    throw Error(ErrorKind::io, fmt::format("cannot read safetensors file '{}': not a regular file", path));
  size = static_cast<uint64_t>(st.st_size);
  return fd;
}

// Reads exactly `size` bytes at `offset`; a short read means the file shrank or is truncated.
void read_exactly(int fd, void* out, uint64_t size, uint64_t offset, const std::string& path, std::string_view what) {
  auto* bytes = static_cast<char*>(out);
  while (size > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, 1u << 30));
    const ssize_t got = ::pread(fd, bytes, chunk, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(ErrorKind::io,
                  fmt::format("cannot read {} of safetensors file '{}': {}", what, path, os_reason(errno)));
    }
    if (got == 0) corrupt(path, fmt::format("the file ended while reading {} (truncated?)", what));
    bytes += got;
    size -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

uint64_t json_offset(const nlohmann::json& v, const std::string& path, const std::string& name, const char* field) {
  if (!v.is_number_unsigned())
    corrupt(path, fmt::format("tensor '{}': {} must hold non-negative integers, got {}", name, field, v.dump()));
  return v.get<uint64_t>();
}

SafetensorsHeader parse_header(const std::string& path, const std::string& text, uint64_t data_size) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, fmt::format("the header is not valid JSON ({})", e.what()));
  }
  if (!json.is_object()) corrupt(path, "the header is not a JSON object");
  SafetensorsHeader header;
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) corrupt(path, "__metadata__ is not an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) corrupt(path, fmt::format("__metadata__ entry '{}' is not a string", k));
        header.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!value.is_object()) corrupt(path, fmt::format("tensor '{}' is not described by an object", name));
    const auto dtype = value.find("dtype");
    const auto shape = value.find("shape");
    const auto offsets = value.find("data_offsets");
    if (dtype == value.end() || shape == value.end() || offsets == value.end())
      corrupt(path, fmt::format("tensor '{}' lacks one of dtype, shape, data_offsets", name));
    if (!dtype->is_string()) corrupt(path, fmt::format("tensor '{}': dtype is not a string", name));
    if (!shape->is_array()) corrupt(path, fmt::format("tensor '{}': shape is not an array", name));
    if (!offsets->is_array() || offsets->size() != 2)
      corrupt(path, fmt::format("tensor '{}': data_offsets is not a pair [begin, end]", name));
    SafetensorsEntry entry;
    entry.name = name;
    entry.dtype = dtype->get<std::string>();
    const DtypeInfo* info = by_code(entry.dtype);
    if (!info)
      corrupt(path, fmt::format("tensor '{}': dtype '{}' is unknown or has no torch dtype", name, entry.dtype));
    uint64_t bytes = info->size;
    for (const auto& dim : *shape) {
      const uint64_t d = json_offset(dim, path, name, "shape");
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || __builtin_mul_overflow(bytes, d, &bytes))
        corrupt(path, fmt::format("tensor '{}': shape {} overflows", name, shape->dump()));
      entry.shape.push_back(static_cast<int64_t>(d));
    }
    entry.begin = json_offset((*offsets)[0], path, name, "data_offsets");
    entry.end = json_offset((*offsets)[1], path, name, "data_offsets");
    if (entry.end < entry.begin || entry.end - entry.begin != bytes)
      corrupt(path, fmt::format("tensor '{}': data_offsets [{}, {}] do not hold {} of shape {} ({} bytes)", name,
                                entry.begin, entry.end, entry.dtype, shape->dump(), bytes));
    header.entries.push_back(std::move(entry));
  }
  // Data order, then the reference reader's rule: the ranges tile the data section exactly.
  std::sort(header.entries.begin(), header.entries.end(),
            [](const auto& a, const auto& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t expected = 0;
  for (const auto& e : header.entries) {
    if (e.begin != expected)
      corrupt(path,
              fmt::format("tensor '{}' starts at byte {} of the data, expected {} (ranges overlap or leave a gap)",
                          e.name, e.begin, expected));
    expected = e.end;
  }
  if (expected > data_size)
    corrupt(path, fmt::format("the header describes {} bytes of tensor data but the file holds {} after the header "
                              "(truncated?)",
                              expected, data_size));
  if (expected < data_size)
    corrupt(path, fmt::format("the file holds {} bytes after the header, {} more than its tensors use", data_size,
                              data_size - expected));
  return header;
}

SafetensorsHeader read_header(int fd, uint64_t file_size, const std::string& path) {
  if (file_size < 8)
    corrupt(path, fmt::format("it is {} bytes long, shorter than the 8-byte header length (truncated?)", file_size));
  uint64_t n = 0;
  read_exactly(fd, &n, 8, 0, path, "the header length");
  if (n > kMaxHeaderSize)
    corrupt(path, fmt::format("the header length is {} bytes, more than the {} the format allows", n, kMaxHeaderSize));
  if (n > file_size - 8)
    corrupt(path, fmt::format("the header length is {} bytes but only {} follow it (truncated?)", n, file_size - 8));
  std::string text(n, '\0');
  read_exactly(fd, text.data(), n, 8, path, "the header");
  SafetensorsHeader header = parse_header(path, text, file_size - 8 - n);
  header.header_size = n;
  return header;
}

// A file written under a temporary name next to its target and renamed over it on commit(); the
// target stays untouched until then (same protocol as write_checkpoint_file).
class AtomicOutput {
 public:
  explicit AtomicOutput(std::string target) : target_(std::move(target)) {
    std::string dir = std::filesystem::path(target_).parent_path().string();
    directory_ = dir.empty() ? "." : dir;
    static std::atomic<uint64_t> counter{0};
    temp_ = fmt::format("{}/.{}.tmp-{}-{}-{:x}", directory_, std::filesystem::path(target_).filename().string(),
                        ::getpid(), counter.fetch_add(1),
                        static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) & 0xffffff);
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      const int e = errno;
      temp_.clear();
      fail(fmt::format("cannot create a temporary file in '{}'", directory_), e);
    }
  }
  ~AtomicOutput() { abandon(); }
  AtomicOutput(const AtomicOutput&) = delete;
  AtomicOutput& operator=(const AtomicOutput&) = delete;

  void write(const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, bytes, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail("writing failed", errno);
      }
      bytes += n;
      size -= static_cast<size_t>(n);
    }
  }

  void commit() {
    if (::fsync(fd_) != 0) fail("fsync failed", errno);
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) fail("closing the temporary file failed", errno);
    if (::rename(temp_.c_str(), target_.c_str()) != 0) fail("renaming the temporary file over it failed", errno);
    temp_.clear();
    const int dir = ::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
      ::fsync(dir);  // best effort: the file itself is complete and in place
      ::close(dir);
    }
  }

 private:
  [[noreturn]] void fail(std::string_view step, int error_number) {
    abandon();
    throw Error(ErrorKind::io,
                fmt::format("cannot write safetensors file '{}': {}: {}", target_, step, os_reason(error_number)));
  }
  void abandon() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
  }

  std::string target_, directory_, temp_;
  int fd_ = -1;
};

}  // namespace

std::optional<std::string> safetensors_dtype(c10::ScalarType type) {
  if (const DtypeInfo* d = by_type(type)) return std::string(d->code);
  return std::nullopt;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  uint64_t size = 0;
  Fd fd = open_for_reading(path, size);
  return read_header(fd.get(), size, path);
}

TensorMap read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  uint64_t size = 0;
  Fd fd = open_for_reading(path, size);
  SafetensorsHeader header = read_header(fd.get(), size, path);
  const uint64_t data_start = 8 + header.header_size;
  TensorMap tensors;
  for (const auto& e : header.entries) {
    // Offsets and sizes were checked against the file in read_header: this reads inside it.
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(by_code(e.dtype)->type));
    read_exactly(fd.get(), t.data_ptr(), e.end - e.begin, data_start + e.begin, path,
                 fmt::format("tensor '{}'", e.name));
    tensors.emplace(e.name, std::move(t));
  }
  if (metadata) *metadata = std::move(header.metadata);
  return tensors;
}

void save_safetensors(const TensorMap& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  struct Item {
    const std::string* name;
    const DtypeInfo* dtype;
    at::Tensor tensor;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("cannot write safetensors file '{}': tensor '{}' is undefined", path, name));
    const DtypeInfo* d = by_type(t.scalar_type());
    if (!d)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("cannot write safetensors file '{}': tensor '{}' has dtype {}, which safetensors cannot "
                              "hold",
                              path, name, c10::toString(t.scalar_type())));
    items.push_back({&name, d, t});
  }
  // The reference writer's order: descending dtype rank, then name.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.dtype->rank != b.dtype->rank ? a.dtype->rank > b.dtype->rank : *a.name < *b.name;
  });
  // ordered_json keeps insertion order: __metadata__ first, then tensors in data order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (const Item& item : items) {
    const uint64_t bytes = static_cast<uint64_t>(item.tensor.numel()) * item.dtype->size;
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = item.dtype->code;
    entry["shape"] = item.tensor.sizes().vec();
    entry["data_offsets"] = {offset, offset + bytes};
    header[*item.name] = std::move(entry);
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorKind::invalid_argument,
                fmt::format("cannot write safetensors file '{}': a name or metadata value is not valid UTF-8 ({})",
                            path, e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const uint64_t n = text.size();

  AtomicOutput out(path);
  out.write(&n, 8);
  out.write(text.data(), text.size());
  for (const Item& item : items) {
    // One tensor at a time on the host, so a model on a device never needs a second full copy.
    const at::Tensor host = item.tensor.detach().to(at::kCPU).contiguous();
    if (host.numel() > 0) out.write(host.data_ptr(), static_cast<size_t>(host.numel()) * item.dtype->size);
  }
  out.commit();
}

}  // namespace fulgur
