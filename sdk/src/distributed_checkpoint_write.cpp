// Writing a distributed checkpoint: each rank's data file, the metadata, and the collective save
// that assembles them in a temporary directory and swaps it into place.
#include <fulgur/checkpoint_io.h>
#include <fulgur/communicator.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>

#include "distributed_checkpoint_format.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <system_error>

#include <fcntl.h>
#include <ftw.h>
#include <unistd.h>

namespace fulgur::dcp {

namespace fs = std::filesystem;

namespace {

std::string os_reason(int error_number) { return std::system_category().message(error_number); }

struct Leaf {
  Path path;
  std::string key;
  c10::IValue value;
};

std::string key_string(const c10::IValue& key, const Path& where) {
  if (key.isString()) return key.toStringRef();
  if (key.isInt()) return std::to_string(key.toInt());
  if (key.isBool()) return key.toBool() ? "True" : "False";  // what Python's str() gives
  throw Error(ErrorKind::checkpoint, fmt::format("cannot write a distributed checkpoint: the dict at '{}' has a key "
                                                 "of type {}; use string or integer keys",
                                                 flatten_key(where), key.tagKind()));
}

// DCP's rule (torch/distributed/checkpoint/_traverse.py): a list is walked only when it holds a
// tensor, a dict or a list that is walked; otherwise it is one leaf, like a tuple or a scalar.
bool is_terminal(const c10::IValue& v) {
  if (v.isGenericDict()) return false;
  if (!v.isList()) return true;
  for (const c10::IValue& entry : v.toListRef()) {
    if ((entry.isGenericDict() || entry.isList()) && !is_terminal(entry)) return false;
    if (entry.isTensor()) return false;
  }
  return true;
}

void flatten(const Path& path, const c10::IValue& v, std::vector<Leaf>& out) {
  if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      Path child = path;
      child.emplace_back(key_string(entry.key(), path));
      flatten(child, entry.value(), out);
    }
  } else if (is_terminal(v)) {
    out.push_back({path, flatten_key(path), v});
  } else {
    const c10::ArrayRef<c10::IValue> items = v.toListRef();
    for (size_t i = 0; i < items.size(); ++i) {
      Path child = path;
      child.emplace_back(static_cast<int64_t>(i));
      flatten(child, items[i], out);
    }
  }
}

std::vector<Leaf> flatten_state(const c10::IValue& state) {
  if (!state.isGenericDict())
    throw Error(ErrorKind::checkpoint, fmt::format("cannot write a distributed checkpoint: the state must be a dict "
                                                   "(GenericDict), not {}",
                                                   state.tagKind()));
  std::vector<Leaf> leaves;
  flatten({}, state, leaves);
  std::set<std::string> seen;
  for (const Leaf& leaf : leaves)
    if (!seen.insert(leaf.key).second)
      throw Error(ErrorKind::checkpoint, fmt::format("cannot write a distributed checkpoint: two leaves flatten to "
                                                     "the key '{}' (a dict key containing '.' collides with a "
                                                     "nested one); rename one of them",
                                                     leaf.key));
  return leaves;
}

// A file written under a temporary name and renamed into place once complete and fsynced.
class DataFile {
 public:
  explicit DataFile(fs::path target) : target_(std::move(target)) {
    temp_ = target_.parent_path() / ("." + target_.filename().string() + ".tmp");
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd_ < 0) fail(fmt::format("cannot create it: {}", os_reason(errno)));
  }
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;
  ~DataFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
  }

  int64_t size() const { return written_; }

  void write(const std::string& bytes) {
    const char* p = bytes.data();
    size_t left = bytes.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(fmt::format("writing failed: {}", os_reason(errno)));
      p += n;
      left -= static_cast<size_t>(n);
    }
    written_ += static_cast<int64_t>(bytes.size());
  }

  void commit() {
    if (::fsync(fd_) != 0) fail(fmt::format("fsync failed: {}", os_reason(errno)));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(fmt::format("closing it failed: {}", os_reason(errno)));
    if (::rename(temp_.c_str(), target_.c_str()) != 0) fail(fmt::format("renaming it failed: {}", os_reason(errno)));
    committed_ = true;
  }

  [[noreturn]] void fail(const std::string& problem) const {
    throw Error(ErrorKind::io,
                fmt::format("cannot write distributed checkpoint file '{}': {}", target_.string(), problem));
  }

  const fs::path& target() const { return target_; }

 private:
  fs::path target_;
  fs::path temp_;
  int fd_ = -1;
  int64_t written_ = 0;
  bool committed_ = false;
};

// Removes a directory tree (or file) if present. Not std::filesystem::remove_all: libtorch.so
// exports its own copy, built against a newer libstdc++, which crashes with Debian 12's (see
// TempDir in tests/test_support.h).
void remove_tree(const fs::path& path) {
  ::nftw(
      path.c_str(), [](const char* file, const struct stat*, int, FTW*) { return std::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);  // best effort: some filesystems cannot sync a directory
  ::close(fd);
}

// A tensor as a chunk blob holds it: on the CPU, contiguous, with a storage of exactly its size
// (torch.save of a view would write the view's whole storage).
at::Tensor compact_cpu(const at::Tensor& t) {
  return t.detach().to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true,
                       at::MemoryFormat::Contiguous);
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// --- RankWrite serialization: little-endian, length-prefixed ----------------------------------

constexpr uint32_t kRankWriteMagic = 0x44435057;  // "WPCD"

struct Encoder {
  std::string out;
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void str(std::string_view s) {
    u64(s.size());
    out += s;
  }
  void ints(const std::vector<int64_t>& v) {
    u64(v.size());
    for (int64_t x : v) i64(x);
  }
};

struct Decoder {
  std::string_view in;
  size_t at = 0;
  [[noreturn]] static void corrupt() {
    throw Error(ErrorKind::distributed,
                "a rank sent checkpoint metadata that cannot be decoded (the ranks run "
                "different Fulgur versions, or the message was damaged)");
  }
  uint64_t u64() {
    if (in.size() - at < 8) corrupt();
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
    at += 8;
    return v;
  }
  int64_t i64() { return static_cast<int64_t>(u64()); }
  uint64_t count() {
    const uint64_t n = u64();
    if (n > in.size()) corrupt();
    return n;
  }
  std::string str() {
    const uint64_t n = count();
    if (in.size() - at < n) corrupt();
    std::string s(in.substr(at, n));
    at += n;
    return s;
  }
  std::vector<int64_t> ints() {
    std::vector<int64_t> v(count());
    for (int64_t& x : v) x = i64();
    return v;
  }
};

// --- the collective's plumbing -------------------------------------------------------------------

// Every rank's `mine`, in rank order: an all-gather of the lengths, then of the bytes padded to
// the longest. On NCCL the buffers live on the current CUDA device.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const bool on_cuda = comm.backend() == "nccl";
  const auto options = at::TensorOptions().device(on_cuda ? at::Device(at::kCUDA) : at::Device(at::kCPU));
  at::Tensor length = at::empty({1}, options.dtype(at::kLong));
  length.fill_(static_cast<int64_t>(mine.size()));
  std::vector<at::Tensor> lengths = comm.all_gather(length);
  std::vector<int64_t> sizes;
  int64_t longest = 1;
  for (const at::Tensor& l : lengths) {
    sizes.push_back(l.cpu().item<int64_t>());
    longest = std::max(longest, sizes.back());
  }
  at::Tensor padded = at::zeros({longest}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> all = comm.all_gather(on_cuda ? padded.to(options.device()) : padded);
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) {
    const at::Tensor bytes = all[r].cpu().contiguous();
    out.emplace_back(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(sizes[r]));
  }
  return out;
}

// Each rank's outcome of a step ("" for success, else its error), known to every rank; a failure
// anywhere becomes the same fulgur::Error on all of them.
std::vector<std::string> agree(Communicator* comm, const std::string& my_error) {
  if (!comm) return {my_error};
  return all_gather_strings(*comm, my_error);
}

void throw_first_failure(const std::vector<std::string>& errors, const std::string& target) {
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      if (errors.size() == 1) throw Error(ErrorKind::checkpoint, errors[r]);
      throw Error(ErrorKind::checkpoint,
                  fmt::format("saving distributed checkpoint '{}' failed on rank {}: {}", target, r, errors[r]));
    }
}

fs::path temp_directory_for(const fs::path& target) {
  return target.parent_path() / ("." + target.filename().string() + ".dcp-tmp");
}

// Rank 0, before anyone writes: the temporary directory, fresh.
void prepare(const fs::path& target, const fs::path& temp) {
  std::error_code ec;
  if (fs::exists(target, ec)) {
    if (!fs::is_directory(target, ec))
      throw Error(ErrorKind::io, fmt::format("cannot save distributed checkpoint '{}': a file of that name exists "
                                             "(a distributed checkpoint is a directory); choose another path",
                                             target.string()));
    if (!fs::is_empty(target, ec) && !is_distributed_checkpoint(target.string()))
      throw Error(ErrorKind::io, fmt::format("cannot save distributed checkpoint '{}': the directory exists and is not "
                                             "a distributed checkpoint (it has no .metadata); refusing to replace "
                                             "it, choose another path",
                                             target.string()));
  }
  fs::create_directories(target.parent_path(), ec);
  if (fs::is_symlink(fs::symlink_status(temp, ec)) || (fs::exists(temp, ec) && !fs::is_directory(temp, ec)))
    throw Error(ErrorKind::io, fmt::format("cannot save distributed checkpoint '{}': '{}' is in the way (the save "
                                           "assembles the checkpoint there, and it is not a directory left by an "
                                           "interrupted save); remove it",
                                           target.string(), temp.string()));
  remove_tree(temp);  // what an interrupted save left
  ec.clear();
  if (!fs::create_directory(temp, ec) || ec)
    throw Error(ErrorKind::io, fmt::format("cannot save distributed checkpoint '{}': cannot create '{}': {}",
                                           target.string(), temp.string(), ec.message()));
}

// Rank 0, after everything is written: `temp` becomes `target`. An existing checkpoint is swapped
// out atomically (renameat2 RENAME_EXCHANGE) and then removed; where the filesystem cannot swap,
// it is moved aside first, so at no point is there neither a complete old nor a complete new one.
void publish(const fs::path& target, const fs::path& temp) {
  sync_directory(temp);
  std::error_code ec;
  auto fail = [&](const std::string& step, int error_number) {
    throw Error(ErrorKind::io, fmt::format("cannot save distributed checkpoint '{}': {}: {}", target.string(), step,
                                           os_reason(error_number)));
  };
  if (!fs::exists(target, ec)) {
    if (::rename(temp.c_str(), target.c_str()) != 0) fail("renaming the new checkpoint into place failed", errno);
  } else if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    remove_tree(temp);  // the previous checkpoint, swapped out
  } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
    const fs::path old = target.parent_path() / ("." + target.filename().string() + ".dcp-old");
    remove_tree(old);
    if (::rename(target.c_str(), old.c_str()) != 0) fail("moving the previous checkpoint aside failed", errno);
    if (::rename(temp.c_str(), target.c_str()) != 0) {
      const int error_number = errno;
      ::rename(old.c_str(), target.c_str());
      fail("renaming the new checkpoint into place failed", error_number);
    }
    remove_tree(old);
  } else {
    fail("swapping the new checkpoint into place failed", errno);
  }
  sync_directory(target.parent_path());
}

}  // namespace

std::string flatten_key(const Path& path) {
  std::string key;
  for (const PathElement& e : path) {
    if (!key.empty()) key += '.';
    if (const auto* s = std::get_if<std::string>(&e))
      key += *s;
    else
      key += std::to_string(std::get<int64_t>(e));
  }
  return key;
}

std::string RankWrite::serialize() const {
  Encoder e;
  e.u64(kRankWriteMagic);
  e.i64(rank);
  e.str(file);
  e.u64(entries.size());
  for (const Entry& entry : entries) {
    e.str(entry.key);
    e.u64(entry.path.size());
    for (const PathElement& p : entry.path) {
      if (const auto* s = std::get_if<std::string>(&p)) {
        e.u64(0);
        e.str(*s);
      } else {
        e.u64(1);
        e.i64(std::get<int64_t>(p));
      }
    }
    e.u64(entry.is_tensor ? 1 : 0);
    e.i64(static_cast<int64_t>(entry.dtype));
    e.ints(entry.global_shape);
    e.ints(entry.offsets);
    e.ints(entry.sizes);
    e.i64(entry.offset);
    e.i64(entry.length);
  }
  return std::move(e.out);
}

RankWrite RankWrite::deserialize(std::string_view bytes) {
  Decoder d{bytes};
  if (d.u64() != kRankWriteMagic) Decoder::corrupt();
  RankWrite w;
  w.rank = d.i64();
  w.file = d.str();
  w.entries.resize(d.count());
  for (Entry& entry : w.entries) {
    entry.key = d.str();
    entry.path.resize(d.count());
    for (PathElement& p : entry.path) {
      if (d.u64() == 0)
        p = d.str();
      else
        p = d.i64();
    }
    entry.is_tensor = d.u64() != 0;
    const int64_t dtype = d.i64();
    if (dtype < 0 || dtype >= static_cast<int64_t>(at::ScalarType::NumOptions)) Decoder::corrupt();
    entry.dtype = static_cast<at::ScalarType>(dtype);
    entry.global_shape = d.ints();
    entry.offsets = d.ints();
    entry.sizes = d.ints();
    entry.offset = d.i64();
    entry.length = d.i64();
  }
  if (d.at != bytes.size()) Decoder::corrupt();
  return w;
}

RankWrite write_rank_file(const std::string& dir, int64_t rank, const c10::IValue& state,
                          const std::map<std::string, Chunk>& placements) {
  const std::vector<Leaf> leaves = flatten_state(state);
  std::set<std::string> tensor_keys;
  for (const Leaf& leaf : leaves)
    if (leaf.value.isTensor()) tensor_keys.insert(leaf.key);
  for (const auto& [key, chunk] : placements)
    if (!tensor_keys.count(key))
      throw Error(ErrorKind::checkpoint, fmt::format("cannot write a distributed checkpoint: a placement names '{}', "
                                                     "which is not a tensor in the state (keys are DCP's flattened "
                                                     "keys, e.g. 'state_dict.layer.weight')",
                                                     key));

  RankWrite result;
  result.rank = rank;
  result.file = fmt::format("__{}_0.distcp", rank);
  DataFile file(fs::path(dir) / result.file);
  auto problem = [&](const std::string& key, const std::string& what) {
    return Error(ErrorKind::checkpoint, fmt::format("cannot write distributed checkpoint file '{}': '{}' {}",
                                                    file.target().string(), key, what));
  };
  for (const Leaf& leaf : leaves) {
    RankWrite::Entry entry;
    entry.key = leaf.key;
    entry.path = leaf.path;
    std::string bytes;
    try {
      if (leaf.value.isTensor()) {
        const at::Tensor& t = leaf.value.toTensor();
        if (!t.defined()) throw problem(leaf.key, "is an undefined tensor");
        if (t.layout() != at::kStrided) throw problem(leaf.key, "is not a dense tensor; only dense tensors are stored");
        entry.is_tensor = true;
        entry.dtype = t.scalar_type();
        detail::dtype_name(entry.dtype);  // refuses dtypes Python has no name for
        entry.sizes = t.sizes().vec();
        auto placement = placements.find(leaf.key);
        if (placement == placements.end()) {
          if (rank != 0) continue;  // replicated: rank 0 writes it (DCP's dedup)
          entry.global_shape = entry.sizes;
          entry.offsets.assign(entry.sizes.size(), 0);
        } else {
          const Chunk& chunk = placement->second;
          entry.global_shape = chunk.global_shape;
          entry.offsets = chunk.offsets;
          if (chunk.global_shape.size() != entry.sizes.size() || chunk.offsets.size() != entry.sizes.size())
            throw problem(leaf.key, fmt::format("has {} dimensions but its placement gives global_shape ({}) and "
                                                "offsets ({})",
                                                entry.sizes.size(), fmt::join(chunk.global_shape, ", "),
                                                fmt::join(chunk.offsets, ", ")));
          for (size_t d = 0; d < entry.sizes.size(); ++d)
            if (chunk.offsets[d] < 0 || chunk.offsets[d] + entry.sizes[d] > chunk.global_shape[d])
              throw problem(leaf.key, fmt::format("is a chunk of sizes ({}) at offsets ({}), which does not fit in "
                                                  "its global_shape ({})",
                                                  fmt::join(entry.sizes, ", "), fmt::join(chunk.offsets, ", "),
                                                  fmt::join(chunk.global_shape, ", ")));
        }
        bytes = detail::torch_save_bytes(compact_cpu(t));
      } else {
        if (rank != 0) continue;  // non-tensor leaves: rank 0 writes them
        bytes = detail::torch_save_bytes(leaf.value);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      std::string reason = e.what();
      if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) reason = c10_error->what_without_backtrace();
      throw problem(leaf.key, fmt::format("cannot be serialized: {}", reason));
    }
    entry.offset = file.size();
    entry.length = static_cast<int64_t>(bytes.size());
    file.write(bytes);
    result.entries.push_back(std::move(entry));
  }
  file.commit();
  return result;
}

void write_metadata(const std::string& dir, const std::vector<RankWrite>& ranks) {
  auto fail = [&](const std::string& what) {
    throw Error(ErrorKind::checkpoint, fmt::format("cannot write distributed checkpoint '{}': {}", dir, what));
  };
  detail::Index index;
  std::map<std::string, size_t> position;
  for (const RankWrite& rank : ranks) {
    for (const RankWrite::Entry& entry : rank.entries) {
      auto [it, fresh] = position.emplace(entry.key, index.items.size());
      if (fresh) {
        detail::Item item;
        item.key = entry.key;
        item.path = entry.path;
        item.is_tensor = entry.is_tensor;
        item.dtype = entry.dtype;
        item.shape = entry.global_shape;
        index.items.push_back(std::move(item));
      }
      detail::Item& item = index.items[it->second];
      const detail::StoredRange range{rank.file, entry.offset, entry.length};
      if (!entry.is_tensor || !item.is_tensor) {
        if (!fresh) fail(fmt::format("'{}' was written by more than one rank (rank {} too)", entry.key, rank.rank));
        item.bytes = range;
        continue;
      }
      if (item.dtype != entry.dtype || item.shape != entry.global_shape)
        fail(fmt::format("the ranks disagree about '{}': {} of shape ({}) against rank {}'s {} of shape ({})",
                         entry.key, c10::toString(item.dtype), fmt::join(item.shape, ", "), rank.rank,
                         c10::toString(entry.dtype), fmt::join(entry.global_shape, ", ")));
      item.chunks.push_back({entry.offsets, entry.sizes, range});
    }
  }
  for (const detail::Item& item : index.items) {
    if (!item.is_tensor) continue;
    int64_t covered = 0;
    std::set<std::vector<int64_t>> starts;
    for (const detail::StoredChunk& chunk : item.chunks) {
      if (numel_of(chunk.sizes) > 0 && !starts.insert(chunk.offsets).second)
        fail(fmt::format("two ranks hold the chunk of '{}' at offsets ({}); give every rank its own part", item.key,
                         fmt::join(chunk.offsets, ", ")));
      covered += numel_of(chunk.sizes);
    }
    if (covered != numel_of(item.shape))
      fail(
          fmt::format("the chunks of '{}' hold {} of its {} elements; every element must be in exactly one rank's "
                      "chunk (check the placements)",
                      item.key, covered, numel_of(item.shape)));
  }
  std::string bytes;
  try {
    bytes = detail::encode_metadata(index);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  atomic_write_text((fs::path(dir) / ".metadata").string(), bytes);
}

namespace {

// Test-only fault injection (as checkpoint_io.cpp's): FULGUR_FAULT_INJECT = "dcp_save:N:R" kills
// rank R with SIGKILL in this process's N-th distributed save, right after its data file is
// written, before the metadata and the swap into place. The sharded-save kill test
// (tests/distributed_test.cpp) uses it. Unset, it costs a getenv per save.
void die_if_injected(int64_t rank) {
  static std::atomic<long> saves{0};
  const long this_save = saves.fetch_add(1) + 1;
#if defined(FULGUR_FAULT_INJECTION)  // test builds only (see checkpoint_io.cpp)
  const char* spec = std::getenv("FULGUR_FAULT_INJECT");
#else
  const char* spec = nullptr;
#endif
  long save_number = 0, victim = -1;
  if (spec && std::sscanf(spec, "dcp_save:%ld:%ld", &save_number, &victim) == 2 && save_number == this_save &&
      victim == rank)
    ::raise(SIGKILL);
}

}  // namespace

void save(const std::string& dir, const c10::IValue& state, const std::map<std::string, Chunk>& placements,
          Communicator* communicator) {
  const int64_t rank = communicator ? communicator->rank() : 0;
  fs::path target = fs::absolute(fs::path(dir)).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();  // a trailing '/'
  const fs::path temp = temp_directory_for(target);

  auto outcome = [](auto&& step) -> std::string {
    try {
      step();
      return {};
    } catch (const std::exception& e) {
      return e.what();
    }
  };

  // 1. Rank 0 makes a fresh temporary directory; every rank learns whether it could.
  std::string error = rank == 0 ? outcome([&] { prepare(target, temp); }) : std::string();
  throw_first_failure(agree(communicator, error), target.string());

  // 2. Every rank writes its file; rank 0 gathers what they wrote (or why they could not).
  RankWrite mine;
  error = outcome([&] { mine = write_rank_file(temp.string(), rank, state, placements); });
  die_if_injected(rank);
  std::vector<std::string> messages;
  if (communicator) {
    messages = all_gather_strings(*communicator, error.empty() ? "k" + mine.serialize() : "e" + error);
  } else {
    messages = {error.empty() ? "k" + mine.serialize() : "e" + error};
  }
  std::vector<std::string> errors;
  std::vector<RankWrite> ranks;
  for (const std::string& m : messages) {
    errors.push_back(!m.empty() && m[0] == 'e' ? m.substr(1) : std::string());
    if (!m.empty() && m[0] == 'k' && rank == 0) ranks.push_back(RankWrite::deserialize(std::string_view(m).substr(1)));
  }
  const bool written = std::all_of(errors.begin(), errors.end(), [](const std::string& e) { return e.empty(); });

  // 3. Rank 0 writes the metadata and swaps the directory into place; everyone learns the outcome.
  if (rank == 0) {
    error = written ? outcome([&] {
      write_metadata(temp.string(), ranks);
      publish(target, temp);
    })
                    : std::string();
    if (!written || !error.empty()) {
      remove_tree(temp);
    }
  }
  throw_first_failure(errors, target.string());
  throw_first_failure(agree(communicator, rank == 0 ? error : std::string()), target.string());
}

}  // namespace fulgur::dcp
