#include <fulgur/data/token_file.h>
#include <fulgur/error.h>
#include <fulgur/log.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fulgur::data {

namespace {

template <typename T>
void widen(const unsigned char* src, int64_t count, int64_t* dst, int64_t vocab, int64_t& bad) {
  for (int64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(T)), sizeof(T));  // unaligned-safe
    dst[i] = static_cast<int64_t>(v);
    if (vocab > 0 && dst[i] >= vocab && bad < 0) bad = i;
  }
}

}  // namespace

TokenFile::TokenFile(std::filesystem::path file, TokenFileOptions options) : file_(std::move(file)), options_(options) {
  const std::string where = file_.string();
  if (options_.block_size_ <= 0)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: block_size = {} must be positive", where, options_.block_size_));
  if (options_.stride_ == 0) options_.stride_ = options_.block_size_;
  if (options_.stride_ < 0)
    throw Error(ErrorKind::invalid_argument, fmt::format("{}: stride = {} must be positive", where, options_.stride_));
  const int fd = ::open(file_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(ErrorKind::io, fmt::format("{}: cannot open: {}", where, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(ErrorKind::io, fmt::format("{}: cannot stat: {}", where, std::strerror(e)));
  }
  const size_t width = options_.dtype_ == TokenType::uint16 ? 2 : 4;
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes % width != 0 && !options_.skip_corrupt_) {
    ::close(fd);
    throw Error(ErrorKind::io, fmt::format("{}: {} bytes is not a whole number of {}-byte tokens (truncated file, or "
                                           "the wrong dtype?); skip_corrupt ignores the partial token",
                                           where, bytes, width));
  }
  tokens_ = static_cast<int64_t>(bytes / width);
  if (bytes % width != 0)
    log::warn(fmt::format("{}: ignoring the last {} bytes (a partial {}-byte token: truncated file?)", where,
                          bytes % width, width));
  if (bytes > 0) {
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw Error(ErrorKind::io, fmt::format("{}: cannot map: {}", where, std::strerror(e)));
    }
    // Windows are read at random offsets: no read-ahead beyond the window.
    ::madvise(p, bytes, MADV_RANDOM);
    map_ = static_cast<const unsigned char*>(p);
    map_size_ = bytes;
  }
  ::close(fd);  // the mapping keeps the file
  const int64_t window = options_.block_size_ + 1;
  windows_ = tokens_ < window ? 0 : (tokens_ - window) / options_.stride_ + 1;
  if (windows_ == 0) {
    if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), map_size_);
    throw Error(ErrorKind::io,
                fmt::format("{}: {} tokens, fewer than one window of block_size + 1 = {}", where, tokens_, window));
  }
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), map_size_);
  map_ = nullptr;
}

int64_t TokenFile::size() const { return windows_; }

Sample TokenFile::get(int64_t index) const {
  if (index < 0 || index >= windows_)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: window {} out of range ({} windows)", file_.string(), index, windows_));
  const int64_t window = options_.block_size_ + 1;
  at::Tensor tokens = at::empty({window}, at::kLong);
  int64_t bad = -1;
  const int64_t start = index * options_.stride_;
  if (options_.dtype_ == TokenType::uint16)
    widen<uint16_t>(map_ + start * 2, window, tokens.data_ptr<int64_t>(), options_.vocab_size_, bad);
  else
    widen<uint32_t>(map_ + start * 4, window, tokens.data_ptr<int64_t>(), options_.vocab_size_, bad);
  if (bad >= 0) {
    if (options_.skip_corrupt_) {
      ++skipped_;
      throw SkipSample();
    }
    throw Error(
        ErrorKind::io,
        fmt::format("{}: sample {} (tokens from {}): token {} at position {} is >= vocab_size {}", file_.string(),
                    index, start, tokens[bad].item<int64_t>(), start + bad, options_.vocab_size_));
  }
  Sample s;
  s.input = tokens.narrow(0, 0, options_.block_size_);
  s.target = tokens.narrow(0, 1, options_.block_size_);
  return s;
}

}  // namespace fulgur::data
