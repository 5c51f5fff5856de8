// The CI smoke of the fuzz targets (tests/fuzz): each entry function runs over its committed seed
// corpus and a fixed set of deterministic mutations of each seed (bit flips, truncations, byte
// runs), in this ordinary build. A crash or an exception other than fulgur::Error fails the test.
// The real coverage-guided runs are scripts/fuzz.sh (libFuzzer, clang, ASan + UBSan).
#include "fuzz/fuzz_targets.h"
#include "test_support.h"

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

}  // namespace

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
