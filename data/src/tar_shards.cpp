// A small ustar reader rather than libarchive: WebDataset shards are plain tar files (no
// compression needed, written by Python's tarfile or GNU tar), read once front to back; the reader
// below is ~150 lines that check every header's checksum and every size against the file, know
// which sample they are in (so errors can name it), and skip a member's bytes without reading them.
// libarchive would add a dependency and a dozen formats this loader does not need.
#include <fulgur/data/tar_shards.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>

namespace fulgur::data {

namespace fs = std::filesystem;

struct TarShards::Member {
  std::string name;
  std::string data;
  int64_t size = 0;
  size_t shard = 0;
};

struct TarShards::Group {
  std::string key;
  std::vector<Member> members;
};

namespace {

constexpr size_t kBlock = 512;

// Octal field (NUL / space terminated), or GNU base-256 (high bit of the first byte set).
bool parse_number(const char* field, size_t len, int64_t& out) {
  const auto* u = reinterpret_cast<const unsigned char*>(field);
  if (u[0] & 0x80) {
    int64_t v = u[0] & 0x3f;
    for (size_t i = 1; i < len; ++i) {
      if (v > (INT64_MAX >> 8)) return false;
      v = (v << 8) | u[i];
    }
    out = v;
    return true;
  }
  size_t i = 0;
  while (i < len && field[i] == ' ') ++i;
  int64_t v = 0;
  bool any = false;
  for (; i < len && field[i] >= '0' && field[i] <= '7'; ++i) {
    if (v > (INT64_MAX >> 3)) return false;
    v = v * 8 + (field[i] - '0');
    any = true;
  }
  for (; i < len; ++i)
    if (field[i] != ' ' && field[i] != '\0') return false;
  out = v;
  return any;
}

std::string field_string(const char* field, size_t len) { return {field, strnlen(field, len)}; }

// WebDataset's rule: the key is the path up to the first '.' of the file name; the extension the rest.
std::pair<std::string, std::string> split_key(const std::string& path) {
  const size_t slash = path.rfind('/');
  const size_t dot = path.find('.', slash == std::string::npos ? 0 : slash + 1);
  if (dot == std::string::npos) return {path, ""};
  return {path.substr(0, dot), path.substr(dot + 1)};
}

at::Tensor bytes_tensor(const std::string& data) {
  at::Tensor t = at::empty({static_cast<int64_t>(data.size())}, at::kByte);
  if (!data.empty()) std::memcpy(t.data_ptr<uint8_t>(), data.data(), data.size());
  return t;
}

// Thrown inside the reader for damaged input; turned into an Error or a skip by the caller.
// `fatal`: the shard cannot be read past this point (a bad header, a short read).
struct Corrupt {
  std::string message;
  bool fatal = true;
};

}  // namespace

TarShards::TarShards(std::vector<fs::path> shards, TarShardOptions options)
    : shards_(std::move(shards)), options_(std::move(options)) {
  if (shards_.empty()) throw Error(ErrorKind::invalid_argument, "TarShards: no shard files");
  if (options_.input_.empty()) throw Error(ErrorKind::invalid_argument, "TarShards: no input extension");
  for (const auto& s : shards_)
    if (std::error_code ec; !fs::is_regular_file(s, ec))
      throw Error(ErrorKind::io, fmt::format("{}: no such shard file", s.string()));
}

TarShards::~TarShards() = default;

void TarShards::start(int64_t, int64_t rank, int64_t num_replicas) {
  rank_ = rank;
  replicas_ = std::max<int64_t>(1, num_replicas);
  shard_ = 0;
  in_.reset();
  pending_.reset();
  sample_ = 0;
}

// The header of the next regular file of the stream (opening the next shard at the end of one),
// or nullopt at the end of the last shard. The stream is left at the member's bytes: consume()
// reads or skips them. Deciding late matters: the member that ends a sample is the first of the
// next one, which may be wanted (built) or not (another replica's, or skipped on resume).
std::optional<TarShards::Member> TarShards::next_member(bool) {
  std::string long_name;
  while (true) {
    if (!in_) {
      if (shard_ >= shards_.size()) return std::nullopt;
      in_ = std::make_unique<std::ifstream>(shards_[shard_], std::ios::binary);
      if (!*in_) throw Error(ErrorKind::io, fmt::format("{}: cannot open", shards_[shard_].string()));
    }
    std::array<char, kBlock> h{};
    in_->read(h.data(), kBlock);
    const std::streamsize got = in_->gcount();
    const bool zero =
        got == static_cast<std::streamsize>(kBlock) && std::all_of(h.begin(), h.end(), [](char c) { return c == 0; });
    if (got == 0 || zero) {  // end of this shard (two zero blocks, or a file ending on a header boundary)
      in_.reset();
      ++shard_;
      continue;
    }
    if (got < static_cast<std::streamsize>(kBlock)) throw Corrupt{"truncated tar header"};
    int64_t stored = 0;
    if (!parse_number(h.data() + 148, 8, stored)) throw Corrupt{"not a tar header (bad checksum field)"};
    int64_t sum = 0;
    for (size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(h[i]);
    if (sum != stored) throw Corrupt{fmt::format("tar header checksum {} does not match {}", sum, stored)};
    int64_t size = 0;
    // Sizes near INT64_MAX would overflow when rounded up to whole blocks.
    if (!parse_number(h.data() + 124, 12, size) || size < 0 || size > INT64_MAX - static_cast<int64_t>(kBlock))
      throw Corrupt{"bad size field in a tar header"};
    std::string name = field_string(h.data(), 100);
    if (std::memcmp(h.data() + 257, "ustar", 5) == 0) {
      std::string prefix = field_string(h.data() + 345, 155);
      if (!prefix.empty()) name = prefix + "/" + name;
    }
    if (!long_name.empty()) name = std::exchange(long_name, {});
    const char type = h[156];
    Member m{std::move(name), {}, size, shard_};
    if (type == '0' || type == '\0' || type == '7') return m;
    if (type == 'L' || type == 'x') {  // the next member's path
      consume(m, true);
      if (type == 'L') {
        long_name = field_string(m.data.data(), m.data.size());
        continue;
      }
      // pax records: "LEN key=value\n"; only the path matters here.
      const std::string& data = m.data;
      size_t pos = 0;
      while (pos < data.size()) {
        const size_t space = data.find(' ', pos);
        if (space == std::string::npos) break;
        const size_t len = std::strtoull(data.c_str() + pos, nullptr, 10);
        if (len == 0 || space >= pos + len || pos + len > data.size()) throw Corrupt{"malformed pax header"};
        const std::string record = data.substr(space + 1, pos + len - space - 2);
        if (record.rfind("path=", 0) == 0) long_name = record.substr(5);
        pos += len;
      }
      continue;
    }
    consume(m, false);  // directories, links, global pax headers
  }
}

// Reads (want) or moves past the bytes of the member whose header was just read.
void TarShards::consume(Member& m, bool want) {
  const int64_t padded = (m.size + static_cast<int64_t>(kBlock) - 1) / static_cast<int64_t>(kBlock) * kBlock;
  if (want) {
    // In pieces, so that memory follows the bytes that are there, not the size the header claims
    // (a 1 KB shard whose header says 8 GiB must be "truncated", not an 8 GiB allocation).
    constexpr int64_t kPiece = int64_t{1} << 20;
    m.data.clear();
    for (int64_t done = 0; done < m.size;) {
      const int64_t piece = std::min(kPiece, m.size - done);
      m.data.resize(static_cast<size_t>(done + piece));
      in_->read(m.data.data() + done, piece);
      if (in_->gcount() != piece) throw Corrupt{fmt::format("truncated in member '{}'", m.name)};
      done += piece;
    }
    in_->ignore(padded - m.size);
    if (in_->gcount() != padded - m.size) throw Corrupt{fmt::format("truncated after member '{}'", m.name)};
    return;
  }
  const std::streampos here = in_->tellg();
  in_->seekg(0, std::ios::end);
  const std::streampos file_end = in_->tellg();
  if (here < 0 || file_end - here < padded) throw Corrupt{fmt::format("truncated in member '{}'", m.name)};
  in_->seekg(here + static_cast<std::streamoff>(padded));
}

// Consecutive members sharing a key. want_data = false leaves the input member's bytes unread.
std::optional<TarShards::Group> TarShards::next_group(bool want_data) {
  auto wanted = [&](const Member& m) { return want_data || split_key(m.name).second != options_.input_; };
  Group g;
  if (pending_) {
    g.key = split_key(pending_->name).first;
    consume(*pending_, wanted(*pending_));
    g.members.push_back(std::move(*pending_));
    pending_.reset();
  }
  while (true) {
    std::optional<Member> m = next_member(want_data);
    if (!m) break;
    std::string key = split_key(m->name).first;
    if (g.members.empty()) {
      g.key = std::move(key);
    } else if (key != g.key || m->shard != g.members[0].shard) {  // a sample never spans shards
      pending_ = std::make_unique<Member>(std::move(*m));         // its bytes wait in the stream
      break;
    }
    consume(*m, wanted(*m));
    g.members.push_back(std::move(*m));
  }
  if (g.members.empty()) return std::nullopt;
  return g;
}

Sample TarShards::make_sample(Group& g) {
  auto find = [&](const std::string& ext) -> Member* {
    for (auto& m : g.members)
      if (split_key(m.name).second == ext) return &m;
    return nullptr;
  };
  auto missing = [&](const std::string& ext) {
    std::vector<std::string> have;
    for (auto& m : g.members) have.push_back("." + split_key(m.name).second);
    return Corrupt{fmt::format("sample '{}' has no .{} member (it has {})", g.key, ext, fmt::join(have, ", ")), false};
  };
  Sample s;
  Member* input = find(options_.input_);
  if (!input) throw missing(options_.input_);
  s.input = bytes_tensor(input->data);
  if (!options_.target_.empty()) {
    Member* t = find(options_.target_);
    if (!t) throw missing(options_.target_);
    if (options_.target_ == "cls") {
      std::string text = t->data;
      text.erase(text.find_last_not_of(" \t\r\n") + 1);
      char* end = nullptr;
      const long long v = std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || end != text.c_str() + text.size())
        throw Corrupt{fmt::format("sample '{}': .cls is '{}', not an integer", g.key, text), false};
      s.target = at::scalar_tensor(static_cast<int64_t>(v), at::kLong);
    } else {
      s.target = bytes_tensor(t->data);
    }
  }
  for (const auto& ext : options_.extra_) {
    Member* m = find(ext);
    if (!m) throw missing(ext);
    s.extra.push_back(bytes_tensor(m->data));
  }
  return s;
}

// One sample of the stream: nullopt at the end; an empty Sample for another replica's sample or a
// skipped one. `build` = false (skip) reads no input bytes but validates exactly as next() does,
// so a resumed run skips and fails where the uninterrupted one did.
std::optional<Sample> TarShards::step(bool build) {
  const int64_t index = sample_;
  const bool mine = index % replicas_ == rank_;
  size_t shard = shard_;
  try {
    std::optional<Group> g = next_group(mine && build);
    if (!g) return std::nullopt;
    shard = g->members[0].shard;
    ++sample_;
    if (!mine) return Sample{};
    Sample s = make_sample(*g);
    if (!s.input.defined()) s.input = at::empty({0}, at::kByte);  // defined: "mine"
    return s;
  } catch (const Corrupt& c) {
    if (c.fatal) shard = shard_;
    const std::string message =
        fmt::format("{}: sample {}: {}", shards_[std::min(shard, shards_.size() - 1)].string(), index, c.message);
    if (!options_.skip_corrupt_) throw Error(ErrorKind::io, message);
    if (sample_ == index) ++sample_;
    if (mine) ++skipped_;
    if (c.fatal) {  // the rest of this shard is unreadable: go on with the next one
      in_.reset();
      pending_.reset();
      shard_ = shard + 1;
    }
    return Sample{};
  }
}

std::optional<Sample> TarShards::next() {
  while (true) {
    std::optional<Sample> s = step(true);
    if (!s || s->input.defined()) return s;
  }
}

int64_t TarShards::skip(int64_t count) {
  int64_t n = 0;
  while (n < count) {
    std::optional<Sample> s = step(false);
    if (!s) break;
    if (s->input.defined()) ++n;
  }
  return n;
}

void write_tar(const fs::path& file, const std::vector<std::pair<std::string, std::string>>& members) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(ErrorKind::io, fmt::format("{}: cannot create", file.string()));
  for (const auto& [name, data] : members) {
    if (name.size() >= 100)
      throw Error(ErrorKind::invalid_argument, fmt::format("write_tar: name '{}' too long", name));
    std::array<char, kBlock> h{};
    std::memcpy(h.data(), name.data(), name.size());
    std::snprintf(h.data() + 100, 8, "%07o", 0644);
    std::snprintf(h.data() + 108, 8, "%07o", 0);
    std::snprintf(h.data() + 116, 8, "%07o", 0);
    std::snprintf(h.data() + 124, 12, "%011llo", static_cast<unsigned long long>(data.size()));
    std::snprintf(h.data() + 136, 12, "%011o", 0);
    h[156] = '0';
    std::memcpy(h.data() + 257, "ustar", 6);
    std::memcpy(h.data() + 263, "00", 2);
    std::memset(h.data() + 148, ' ', 8);
    unsigned sum = 0;
    for (char c : h) sum += static_cast<unsigned char>(c);
    std::snprintf(h.data() + 148, 8, "%06o", sum);
    h[155] = ' ';
    out.write(h.data(), kBlock);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    const std::array<char, kBlock> zeros{};
    out.write(zeros.data(), static_cast<std::streamsize>((kBlock - data.size() % kBlock) % kBlock));
  }
  const std::array<char, 2 * kBlock> end{};
  out.write(end.data(), end.size());
  if (!out) throw Error(ErrorKind::io, fmt::format("{}: write error", file.string()));
}

}  // namespace fulgur::data
