// The IDX reader of the Fashion-MNIST example, in its own file so that the fuzz target
// (tests/fuzz/idx_fuzz.cpp) builds it without the DataModule and models.
#include "fashion_mnist.h"

#include <fulgur/error.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <memory>
#include <system_error>
#include <vector>

namespace fulgur::examples {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void io_error(const fs::path& file, const std::string& what) {
  throw Error(ErrorKind::io, fmt::format("{}: {}", file.string(), what));
}

// Closes the gzFile on every path out of read_idx, including the throwing ones.
struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

std::string gz_error_text(gzFile f) {
  int code = Z_OK;
  const char* text = gzerror(f, &code);
  if (code == Z_ERRNO) return std::strerror(errno);
  return text ? text : "unknown zlib error";
}

// Reads exactly `size` bytes; returns how many were read before end of file. Data errors (bad CRC,
// not deflate) throw: a corrupt download must not pass as a short one.
size_t read_fully(gzFile f, const fs::path& file, void* data, size_t size) {
  auto* out = static_cast<unsigned char*>(data);
  size_t done = 0;
  while (done < size) {
    // gzread takes an unsigned int count; read in chunks well below its limit.
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(size - done, size_t{1} << 30));
    const int n = gzread(f, out + done, chunk);
    if (n < 0) io_error(file, fmt::format("cannot decompress: {} (is the file corrupt?)", gz_error_text(f)));
    if (n == 0) {
      int code = Z_OK;
      gzerror(f, &code);
      if (code != Z_OK && code != Z_BUF_ERROR)
        io_error(file, fmt::format("cannot decompress: {} (is the file corrupt?)", gz_error_text(f)));
      break;
    }
    done += static_cast<size_t>(n);
  }
  return done;
}

}  // namespace

at::Tensor read_idx(const fs::path& file, int64_t expected_dims) {
  std::error_code ec;
  if (!fs::exists(file, ec)) io_error(file, fmt::format("file not found; {}", kFashionMnistPackageHint));
  errno = 0;
  GzFile f(gzopen(file.c_str(), "rb"));
  if (!f) io_error(file, fmt::format("cannot open: {}", errno ? std::strerror(errno) : "out of memory"));
  gzbuffer(f.get(), 1 << 18);

  // IDX header: two zero bytes, the element type (0x08 = unsigned byte), the number of dimensions,
  // then one big-endian uint32 per dimension.
  std::array<unsigned char, 4> magic{};
  if (read_fully(f.get(), file, magic.data(), magic.size()) != magic.size())
    io_error(file, "too short for an IDX header (4-byte magic number)");
  const uint32_t magic_value = (uint32_t{magic[0]} << 24) | (uint32_t{magic[1]} << 16) | (magic[2] << 8) | magic[3];
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08)
    io_error(file, fmt::format("bad magic number 0x{:08x}: not an IDX file of unsigned bytes (expected 0x000008{:02x})",
                               magic_value, expected_dims));
  if (magic[3] != expected_dims)
    io_error(file, fmt::format("magic number 0x{:08x} announces {} dimension(s), expected {} (0x000008{:02x}); "
                               "is this the {} file?",
                               magic_value, magic[3], expected_dims, expected_dims,
                               expected_dims == 1 ? "labels" : "images"));

  std::vector<int64_t> shape;
  uint64_t count = 1;
  for (int64_t d = 0; d < expected_dims; ++d) {
    std::array<unsigned char, 4> b{};
    if (read_fully(f.get(), file, b.data(), b.size()) != b.size())
      io_error(file, fmt::format("truncated IDX header: missing size of dimension {}", d));
    const uint32_t size = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
    if (size == 0) io_error(file, fmt::format("IDX header: dimension {} has size 0", d));
    count *= size;
    // Guards the allocation below against a corrupt header (no real dataset is this large).
    if (count > (uint64_t{1} << 34)) io_error(file, "IDX header announces more than 16 GiB of data; corrupt header?");
    shape.push_back(size);
  }

  // The header is only a claim: a 16-byte file may announce 16 GiB (found by fuzzing, an
  // out-of-memory abort). Read in bounded chunks, so memory follows the data actually present.
  // Each chunk is an uninitialised tensor that gzread fills: no zero-fill and, for a file of one
  // chunk (Fashion-MNIST's 47 MB of images), no copy either: the data was touched twice more
  // before (a std::vector's zeroing, then a copy into the tensor), ~23 k page faults at start.
  std::vector<at::Tensor> chunks;
  size_t got = 0;
  while (got < count) {
    const size_t size = std::min<size_t>(count - got, size_t{64} << 20);
    at::Tensor chunk = at::empty({static_cast<int64_t>(size)}, at::kByte);
    const size_t n = read_fully(f.get(), file, chunk.data_ptr<uint8_t>(), size);
    got += n;
    chunks.push_back(n == size ? chunk : chunk.narrow(0, 0, static_cast<int64_t>(n)));
    if (n < size) break;
  }
  if (got != count)
    io_error(file, fmt::format("truncated: the header announces {} ({} bytes of data) but the file holds {} bytes",
                               fmt::join(shape, "x"), count, got));
  unsigned char extra = 0;
  if (read_fully(f.get(), file, &extra, 1) != 0)
    io_error(file, fmt::format("has data after the {} bytes its header announces ({}); corrupt file?", count,
                               fmt::join(shape, "x")));
  return (chunks.size() == 1 ? chunks.front() : at::cat(chunks)).view(shape);
}

}  // namespace fulgur::examples
