// The CI smoke of the fuzz targets (tests/fuzz): each entry function runs over its committed seed
// corpus and a fixed set of deterministic mutations of each seed (bit flips, truncations, byte
// runs), in this ordinary build. A crash or an exception other than fulgur::Error fails the test.
// The real coverage-guided runs are scripts/fuzz.sh (libFuzzer, clang, ASan + UBSan).
#include "fuzz/fuzz_targets.h"
#include "test_support.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/distributed_checkpoint.h>

#include <ATen/core/ivalue.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <functional>

namespace fulgur {
namespace {

namespace fs = std::filesystem;
using Entry = int (*)(const uint8_t*, size_t);

std::vector<std::string> seeds(const std::string& target) {
  const fs::path dir = fs::path(FULGUR_TEST_SOURCE_DIR) / "tests/fuzz/corpus" / target;
  REQUIRE_MESSAGE(fs::is_directory(dir), "seed corpus missing: " << dir.string());
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(test::read_bytes(f));
  REQUIRE(!out.empty());
  return out;
}

// xorshift64*: the same mutations on every run and machine.
struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1DULL;
  }
  size_t below(size_t n) { return n ? static_cast<size_t>(next() % n) : 0; }
};

std::string mutate(const std::string& seed, Rng& rng) {
  std::string m = seed;
  const int edits = 1 + static_cast<int>(rng.below(4));
  for (int e = 0; e < edits; ++e) {
    switch (rng.below(5)) {
      case 0:  // flip a bit
        if (!m.empty()) m[rng.below(m.size())] ^= static_cast<char>(1u << rng.below(8));
        break;
      case 1:  // truncate
        m.resize(rng.below(m.size() + 1));
        break;
      case 2: {  // overwrite a run with an interesting byte
        const char bytes[] = {'\0', '\xff', '\x7f', '\x80', '[', '"', '='};
        if (m.empty()) break;
        const size_t at = rng.below(m.size());
        const size_t len = std::min<size_t>(1 + rng.below(8), m.size() - at);
        std::fill_n(m.begin() + static_cast<std::ptrdiff_t>(at), len, bytes[rng.below(sizeof(bytes))]);
        break;
      }
      case 3:  // duplicate a slice
        if (!m.empty()) {
          const size_t at = rng.below(m.size());
          m.insert(rng.below(m.size() + 1), m.substr(at, 1 + rng.below(16)));
        }
        break;
      default:  // write a random 32-bit value (sizes, offsets, counts)
        if (m.size() >= 4) {
          const uint32_t v = static_cast<uint32_t>(rng.next());
          std::memcpy(m.data() + rng.below(m.size() - 3), &v, 4);
        }
    }
  }
  return m;
}

void smoke(const std::string& target, Entry entry, int mutations_per_seed) {
  Rng rng{0x9E3779B97F4A7C15ULL ^ std::hash<std::string>{}(target)};
  size_t runs = 0;
  for (const std::string& seed : seeds(target)) {
    CHECK(entry(reinterpret_cast<const uint8_t*>(seed.data()), seed.size()) == 0);
    ++runs;
    for (int i = 0; i < mutations_per_seed; ++i) {
      const std::string input = mutate(seed, rng);
      CHECK(entry(reinterpret_cast<const uint8_t*>(input.data()), input.size()) == 0);
      ++runs;
    }
  }
  MESSAGE(target << ": " << runs << " inputs");
}

// The process's peak resident set so far, in bytes.
int64_t peak_rss_bytes() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return int64_t{usage.ru_maxrss} * 1024;
}

// Reads `file` as a checkpoint, which must fail with a checkpoint error naming it and saying
// `expected`, without the peak RSS growing by as much as 1 GiB on the way.
void check_unreadable(const fs::path& file, const std::string& expected) {
  const int64_t peak_before = peak_rss_bytes();
  try {
    (void)read_checkpoint_file(file.string(), c10::Device(c10::kCPU));
    FAIL("reading " << file.string() << " did not fail");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::checkpoint);
    CHECK_MESSAGE(std::string(e.what()).find(file.string()) != std::string::npos, e.what());
    CHECK_MESSAGE(std::string(e.what()).find(expected) != std::string::npos, e.what());
  }
  CHECK(peak_rss_bytes() - peak_before < (int64_t{1} << 30));
}

// `bytes` with the central directory header of `record` (an archive member's full name) patched:
// `patch(header_offset)` edits it in place.
std::string patch_central_header(std::string bytes, std::string_view record,
                                 const std::function<void(std::string&, size_t)>& patch) {
  for (size_t at = bytes.find("PK\x01\x02"); at != std::string::npos; at = bytes.find("PK\x01\x02", at + 1))
    if (bytes.compare(at + 46, record.size(), record) == 0) {
      patch(bytes, at);
      return bytes;
    }
  FAIL("no central directory header for " << record);
  return bytes;
}

void put_le32(std::string& bytes, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) bytes[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

// Two 1.7 KB checkpoints found by scripts/fuzz.sh: a BINUNICODE in data.pkl declares ~4 GiB
// (0xFFFF0005 and 0xFFFFFA02 bytes), and LibTorch's unpickler sized a string by it before finding
// the bytes missing (libFuzzer: out-of-memory at 4 GiB, and RSS past 5 GB).
TEST_CASE("checkpoint reader: a pickle string longer than the pickle is an error, not a 4 GiB allocation") {
  const fs::path corpus = fs::path(FULGUR_TEST_SOURCE_DIR) / "tests/fuzz/corpus/checkpoint";
  check_unreadable(corpus / "regression_4gib_binunicode.ckpt",
                   "its pickle is cut short: the argument of opcode 0x58 at offset 6 runs past the end of the pickle "
                   "(301 bytes) (it declares 4294901765 bytes");
  check_unreadable(corpus / "regression_rss_5gib_binunicode.ckpt",
                   "its pickle is cut short: the argument of opcode 0x58");
}

// LibTorch sizes a record's buffer by the central directory's uncompressed size before reading
// it, and miniz checks that size only for stored records: the framing check bounds it and the
// zip64 end records by the file.
TEST_CASE("checkpoint reader: zip records and end records that do not fit the file are errors") {
  test::TempDir dir;
  const std::string small =
      test::read_bytes(fs::path(FULGUR_TEST_SOURCE_DIR) / "tests/fuzz/corpus/checkpoint/small.ckpt");

  // data.pkl marked deflated, declaring 2 GiB.
  const fs::path inflated = dir / "inflated.ckpt";
  test::write_bytes(inflated, patch_central_header(small, "archive/data.pkl", [](std::string& b, size_t at) {
                      b[at + 10] = 8;
                      put_le32(b, at + 24, 0x7fffffff);
                    }));
  check_unreadable(inflated, "record 'archive/data.pkl' declares 2147483647 bytes, more than its 301 compressed");

  // data/0's data said to start past the central directory.
  const fs::path outside = dir / "outside.ckpt";
  test::write_bytes(outside, patch_central_header(small, "archive/data/0",
                                                  [](std::string& b, size_t at) { put_le32(b, at + 42, 0x00100000); }));
  check_unreadable(outside, "record 'archive/data/0' has no local header at offset 1048576");

  // The zip64 locator pointing past the file.
  std::string locator = small;
  const size_t at = locator.rfind("PK\x06\x07");
  REQUIRE(at != std::string::npos);
  put_le32(locator, at + 8, 0x40000000);
  const fs::path zip64 = dir / "zip64.ckpt";
  test::write_bytes(zip64, locator);
  check_unreadable(zip64, "the zip64 end-of-central-directory locator points at offset 1073741824");
}

// A dcp_metadata seed (4-byte length, `.metadata`, rank 0's data file) as a checkpoint directory.
std::string dcp_directory(const test::TempDir& dir, const std::string& seed) {
  const std::string bytes =
      test::read_bytes(fs::path(FULGUR_TEST_SOURCE_DIR) / "tests/fuzz/corpus/dcp_metadata" / seed);
  REQUIRE(bytes.size() >= 4);
  uint32_t length = 0;
  std::memcpy(&length, bytes.data(), 4);
  REQUIRE(bytes.size() - 4 >= length);
  test::write_bytes(dir / ".metadata", bytes.substr(4, length));
  test::write_bytes(dir / "__0_0.distcp", bytes.substr(4 + length));
  return dir.path().string();
}

// The same two faults in a distributed checkpoint: an entry's torch.save pickle declaring a ~4 GiB
// string (LibTorch's unpickler allocated it: 4.4 GB peak RSS for a 3.7 KB checkpoint), and a
// `.metadata` declaring a 6e11-element tensor over a 2x3 entry (at::empty threw a c10::Error
// out of read_all, not a fulgur::Error).
TEST_CASE("distributed checkpoint reader: corrupt entries and shapes are errors, not huge allocations") {
  {
    test::TempDir dir;
    const dcp::Reader reader(dcp_directory(dir, "regression_4gib_string_entry.dcp"));
    const int64_t peak_before = peak_rss_bytes();
    try {
      (void)reader.read_value("name");
      FAIL("reading the corrupt entry did not fail");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::checkpoint);
      CHECK_MESSAGE(std::string(e.what()).find("the entry of 'name'") != std::string::npos, e.what());
      CHECK_MESSAGE(std::string(e.what()).find("its pickle is cut short") != std::string::npos, e.what());
    }
    CHECK(peak_rss_bytes() - peak_before < (int64_t{1} << 30));
  }
  {
    test::TempDir dir;
    const dcp::Reader reader(dcp_directory(dir, "regression_huge_shape.dcp"));
    try {
      (void)reader.read("w");
      FAIL("reading the corrupt tensor did not fail");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::checkpoint);
      CHECK_MESSAGE(std::string(e.what()).find("declares sizes (2, 300000000000), more than the 1577 bytes of its "
                                               "entry in '__0_0.distcp' can hold") != std::string::npos,
                    e.what());
    }
  }
}

TEST_CASE("fuzz smoke: TOML config parse and schema validation") { smoke("config", fuzz::config, 300); }
TEST_CASE("fuzz smoke: ELF-note reader") { smoke("elf_note", fuzz::elf_note, 2000); }
TEST_CASE("fuzz smoke: checkpoint reader") { smoke("checkpoint", fuzz::checkpoint, 300); }
TEST_CASE("fuzz smoke: safetensors reader") { smoke("safetensors", fuzz::safetensors, 1000); }
TEST_CASE("fuzz smoke: IDX reader") { smoke("idx", fuzz::idx, 500); }
TEST_CASE("fuzz smoke: CSV records and CsvDataset") { smoke("csv", fuzz::csv, 500); }
TEST_CASE("fuzz smoke: JPEG and PNG through ImageFolder") { smoke("image", fuzz::image, 300); }
TEST_CASE("fuzz smoke: tar shard reader") { smoke("tar", fuzz::tar, 500); }
TEST_CASE("fuzz smoke: token file reader") { smoke("token", fuzz::token, 500); }
TEST_CASE("fuzz smoke: distributed checkpoint metadata") { smoke("dcp_metadata", fuzz::dcp_metadata, 300); }

}  // namespace fulgur
