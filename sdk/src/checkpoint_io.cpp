// Atomic checkpoint and artifact files. See checkpoint_io.h for the contract.
//
// Writing does what torch::pickle_save does (pickle the value, then a zip with data.pkl and one
// record per tensor storage) with two differences that matter here:
//   - the zip is streamed into the temporary file instead of being built in memory first, so a
//     checkpoint costs no second copy of the model in RAM;
//   - the pickle carries no TorchScript type tags and no specialised lists: pickle_save emits
//     torch.jit._pickle.restore_type_tag / build_intlist / build_tensorlist globals, which Python's
//     torch.load(weights_only=True) refuses. Plain dicts and lists are what torch.save writes.
#include <fulgur/checkpoint_io.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pickle_compat.h"

namespace fulgur {
namespace {

std::string os_reason(int error_number) { return std::system_category().message(error_number); }

std::string parent_directory(const std::string& path) {
  std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? std::string(".") : parent;
}

// Test-only fault injection, read once from the environment: FULGUR_FAULT_INJECT =
// "checkpoint_write:N:PHASE" kills this process with SIGKILL during its N-th checkpoint write
// (1-based), at PHASE: "partial" (some bytes of the temporary file written), "before_rename" (the
// temporary file complete and fsynced) or "after_rename" (renamed, directory not yet fsynced).
// The crash-resume test (tests/kill_resume_test.cpp) uses it to land a SIGKILL inside a write
// deterministically. Unset, it costs a comparison per checkpoint write and per chunk written.
enum class FaultPhase { none, partial, before_rename, after_rename };

struct FaultInjection {
  long write_number = 0;
  FaultPhase phase = FaultPhase::none;
};

// Compiled only into builds with the tests (CMake option FULGUR_FAULT_INJECTION, on with
// BUILD_TESTING): a release build ignores the variable.
const FaultInjection& fault_injection() {
  static const FaultInjection injection = [] {
    FaultInjection f;
#if defined(FULGUR_FAULT_INJECTION)
    const char* spec = std::getenv("FULGUR_FAULT_INJECT");
#else
    const char* spec = nullptr;
#endif
    char phase[32] = {};
    if (spec && std::sscanf(spec, "checkpoint_write:%ld:%31s", &f.write_number, phase) == 2) {
      const std::string_view p(phase);
      f.phase = p == "partial"         ? FaultPhase::partial
                : p == "before_rename" ? FaultPhase::before_rename
                : p == "after_rename"  ? FaultPhase::after_rename
                                       : FaultPhase::none;
    }
    return f;
  }();
  return injection;
}

std::atomic<long> checkpoint_writes{0};

// Which phase of the current checkpoint write dies (none for all other writes).
FaultPhase fault_for_this_write() {
  const FaultInjection& f = fault_injection();
  if (f.phase == FaultPhase::none) return FaultPhase::none;
  return checkpoint_writes.fetch_add(1) + 1 == f.write_number ? f.phase : FaultPhase::none;
}

void die_if(FaultPhase armed, FaultPhase here) {
  if (armed != FaultPhase::none && armed == here) ::raise(SIGKILL);
}

// A file written under a temporary name next to its target and renamed over it on commit().
// Until then the target is untouched; destroying an uncommitted AtomicFile removes the temporary.
class AtomicFile {
 public:
  // `what` names the artifact in error messages ("checkpoint", "file").
  AtomicFile(std::string target, std::string_view what) : target_(std::move(target)), what_(what) {
    if (target_.empty()) fail(ErrorKind::io, "the path is empty", 0);
    directory_ = parent_directory(target_);
    const std::string base = std::filesystem::path(target_).filename().string();
    if (base.empty() || base == "." || base == "..") fail(ErrorKind::io, "the path names a directory, not a file", 0);
    static std::atomic<uint64_t> counter{0};
    // O_EXCL on a name unique to this process and call; retried in the unlikely case that a
    // stale temporary of an earlier process with the same pid is in the way.
    for (int attempt = 0; attempt < 16; ++attempt) {
      const auto nonce = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
      temp_path_ =
          fmt::format("{}/.{}.tmp-{}-{}-{:x}", directory_, base, ::getpid(), counter.fetch_add(1), nonce & 0xffffff);
      // 0666 & ~umask, like any file the user creates; O_CLOEXEC so launched children never hold it.
      fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0) return;
      if (errno != EEXIST) break;
    }
    const int error_number = errno;
    temp_path_.clear();
    fail(ErrorKind::io, fmt::format("cannot create a temporary file in '{}'", directory_), error_number,
         error_number == ENOENT ? " (the directory does not exist; create it first)" : "");
  }

  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  ~AtomicFile() { abandon(); }

  // Writes everything or records the first error (later writes are skipped). Never throws: the
  // zip writer calls this from inside miniz, and a throw there would end in std::terminate.
  void write(const void* data, size_t size) noexcept {
    if (write_errno_ != 0) return;
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t written = ::write(fd_, bytes, size);
      if (written < 0) {
        if (errno == EINTR) continue;
        write_errno_ = errno;
        return;
      }
      bytes += written;
      size -= static_cast<size_t>(written);
      written_ += static_cast<size_t>(written);
    }
    if (written_ >= 4096) die_if(fault_, FaultPhase::partial);
  }

  bool failed() const { return write_errno_ != 0; }
  void arm(FaultPhase phase) { fault_ = phase; }

  // fsync, close, rename over the target, fsync the directory. Throws (and cleans up) on failure.
  void commit() {
    if (write_errno_ != 0) fail(ErrorKind::io, "writing failed", write_errno_);
    if (::fsync(fd_) != 0) fail(ErrorKind::io, "fsync failed", errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(ErrorKind::io, "closing the temporary file failed", errno);
    die_if(fault_, FaultPhase::before_rename);
    if (::rename(temp_path_.c_str(), target_.c_str()) != 0) {
      const int error_number = errno;
      fail(ErrorKind::io, "renaming the temporary file over it failed", error_number,
           error_number == EISDIR ? " (a directory of that name exists)" : "");
    }
    temp_path_.clear();  // it is the target now: nothing to remove any more
    die_if(fault_, FaultPhase::after_rename);
    sync_directory();
    remove_abandoned_temporaries();
  }

  [[noreturn]] void fail(ErrorKind kind, std::string_view step, int error_number, std::string_view hint = "") {
    abandon();
    std::string message = fmt::format("cannot write {} '{}': {}", what_, target_, step);
    if (error_number != 0) message += fmt::format(": {}", os_reason(error_number));
    message += hint;
    throw Error(kind, message);
  }

 private:
  void abandon() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
    temp_path_.clear();
  }

  // Makes the rename itself durable. Filesystems that cannot sync a directory (EINVAL) are fine;
  // a real I/O error is reported even though the new file is already in place.
  // Temporaries of this target left by writers that no longer exist (a process killed inside a
  // write: SIGKILL runs no destructor). The writer's pid is in the name; a file whose process is
  // alive (another writer, or a reused pid) is left alone. Best effort: failures are ignored.
  void remove_abandoned_temporaries() const {
    const std::string prefix = "." + std::filesystem::path(target_).filename().string() + ".tmp-";
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(directory_, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(prefix, 0) != 0) continue;
      long pid = 0;
      if (std::sscanf(name.c_str() + prefix.size(), "%ld-", &pid) != 1 || pid <= 0) continue;
      if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
      std::error_code ignored;
      std::filesystem::remove(entry.path(), ignored);
    }
  }

  void sync_directory() {
    const int dir_fd = ::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) return;  // e.g. a directory we may write but not read: nothing more to do
    const int result = ::fsync(dir_fd);
    const int error_number = errno;
    ::close(dir_fd);
    if (result != 0 && error_number != EINVAL && error_number != ENOTSUP)
      throw Error(ErrorKind::io, fmt::format("{} '{}' was written, but syncing its directory '{}' failed: {}; it may "
                                             "not survive a crash of the machine",
                                             what_, target_, directory_, os_reason(error_number)));
  }

  std::string target_;
  std::string what_;
  size_t written_ = 0;
  FaultPhase fault_ = FaultPhase::none;
  std::string directory_;
  std::string temp_path_;
  int fd_ = -1;
  int write_errno_ = 0;
};

std::string torch_reason(const c10::Error& e) { return e.what_without_backtrace(); }

[[noreturn]] void unreadable(const std::string& path, std::string_view problem) {
  throw Error(ErrorKind::checkpoint, fmt::format("cannot read checkpoint '{}': {}", path, problem));
}

// `bytes[at, at + n)` (n <= 8) as an unsigned little-endian integer; the caller checks the bounds.
uint64_t le(std::string_view bytes, size_t at, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
  return v;
}

// Where in `tail` (the last bytes of a file) a complete zip end-of-central-directory record starts:
// its signature, 18 fixed bytes, then a comment whose length it states, ending the file.
std::optional<size_t> end_of_central_directory(std::string_view tail) {
  constexpr std::string_view kSignature("PK\x05\x06", 4);
  constexpr size_t kRecordSize = 22;
  for (size_t at = tail.rfind(kSignature); at != std::string::npos; at = tail.rfind(kSignature, at - 1)) {
    if (at + kRecordSize <= tail.size() && at + kRecordSize + le(tail, at + 20, 2) == tail.size()) return at;
    if (at == 0) break;
  }
  return std::nullopt;
}

// The largest size deflate can expand `compressed` bytes to (its best ratio is about 1032:1).
constexpr uint64_t max_inflated_size(uint64_t compressed) { return compressed * 1032 + 1024; }

// Cheap checks that turn the common failures (missing, empty, not a zip, cut short) into a
// precise message before miniz reports them as "failed finding central directory", and then the
// zip structure against the file's size: the (zip64) end records, the central directory, and each
// record's local header and sizes. LibTorch allocates what a record declares before reading it
// (getRecord sizes its buffer by the central directory's uncompressed size), so an archive that
// declares more than it can hold must stop here, not in a multi-gigabyte allocation.
void check_archive_framing(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int error_number = errno;
    unreadable(path, error_number == ENOENT ? std::string("the file does not exist") : os_reason(error_number));
  }
  if (S_ISDIR(info.st_mode)) unreadable(path, "it is a directory, not a checkpoint file");
  const auto size = static_cast<uint64_t>(info.st_size);
  if (size == 0) unreadable(path, "the file is empty (0 bytes); it was probably cut short while being written");

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) unreadable(path, os_reason(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  // Up to `count` bytes at `offset` (fewer at the end of the file); callers bound `count` by the
  // file's size.
  auto read_at = [&](uint64_t offset, uint64_t count) {
    std::string bytes(static_cast<size_t>(count), '\0');
    size_t done = 0;
    while (done < count) {
      const ssize_t n = ::pread(fd, bytes.data() + done, count - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    bytes.resize(done);
    return bytes;
  };
  const std::string head = read_at(0, 4);
  // The end-of-central-directory record (22 bytes + a comment of up to 64 KiB) closes every zip.
  const uint64_t tail_size = std::min<uint64_t>(size, 22 + 65535);
  const uint64_t tail_offset = size - tail_size;
  const std::string tail = read_at(tail_offset, tail_size);

  if (head.size() < 4 || head.compare(0, 4, "PK\x03\x04", 4) != 0) {
    if (!head.empty() && static_cast<unsigned char>(head[0]) == 0x80)
      unreadable(path,
                 "not a PyTorch zip archive: it is a legacy (pre-1.6, non-zip) torch.save file, which "
                 "libtorch cannot read; load and re-save it in Python with torch.save(obj, path)");
    unreadable(path, "not a PyTorch zip archive (it does not start with the zip signature)");
  }
  const std::optional<size_t> eocd_in_tail = end_of_central_directory(tail);
  if (!eocd_in_tail)
    unreadable(path, fmt::format("the file is truncated: the zip end-of-central-directory record is missing "
                                 "({} bytes on disk); it was probably cut short while being written or copied",
                                 size));

  auto corrupt = [&](std::string_view what) {
    unreadable(path, fmt::format("the zip structure is corrupt ({} bytes on disk): {}", size, what));
  };
  const std::string_view eocd = std::string_view(tail).substr(*eocd_in_tail);
  const uint64_t eocd_offset = tail_offset + *eocd_in_tail;
  uint64_t entries = le(eocd, 10, 2), cd_size = le(eocd, 12, 4), cd_offset = le(eocd, 16, 4);
  uint64_t cd_end_limit = eocd_offset;  // the central directory ends before the end records
  // The zip64 locator (20 bytes) right before the end record points at the zip64 end record,
  // which holds the 64-bit counts and offsets (LibTorch always writes both).
  if (eocd_offset >= 20) {
    const std::string locator = read_at(eocd_offset - 20, 20);
    if (locator.size() == 20 && locator.compare(0, 4, "PK\x06\x07", 4) == 0) {
      const uint64_t record_offset = le(locator, 8, 8);
      if (record_offset > eocd_offset - 20 || eocd_offset - 20 - record_offset < 56)
        corrupt(
            fmt::format("the zip64 end-of-central-directory locator points at offset {}, outside the space "
                        "before it (which ends at {})",
                        record_offset, eocd_offset - 20));
      const std::string record = read_at(record_offset, 56);
      if (record.size() < 56 || record.compare(0, 4, "PK\x06\x06", 4) != 0)
        corrupt(fmt::format("there is no zip64 end-of-central-directory record at offset {}", record_offset));
      entries = le(record, 32, 8);
      cd_size = le(record, 40, 8);
      cd_offset = le(record, 48, 8);
      cd_end_limit = record_offset;
    }
  }
  if (cd_offset > cd_end_limit || cd_size > cd_end_limit - cd_offset)
    corrupt(
        fmt::format("the central directory ({} bytes at offset {}) does not fit before the end records at "
                    "offset {}",
                    cd_size, cd_offset, cd_end_limit));
  constexpr uint64_t kHeaderSize = 46;  // a central directory header without its name and fields
  if (entries > cd_size / kHeaderSize)
    corrupt(fmt::format("the end record declares {} records, more than a {}-byte central directory can hold", entries,
                        cd_size));

  const std::string cd = read_at(cd_offset, cd_size);
  if (cd.size() != cd_size) corrupt("the central directory cannot be read in full");
  size_t at = 0;
  for (uint64_t i = 0; i < entries; ++i) {
    if (cd.size() - at < kHeaderSize || cd.compare(at, 4, "PK\x01\x02", 4) != 0)
      corrupt(fmt::format("central directory header {} of {} (at offset {}) is missing or cut short", i + 1, entries,
                          cd_offset + at));
    const uint64_t method = le(cd, at + 10, 2);
    uint64_t compressed = le(cd, at + 20, 4), uncompressed = le(cd, at + 24, 4), local = le(cd, at + 42, 4);
    const uint64_t name_length = le(cd, at + 28, 2), extra_length = le(cd, at + 30, 2),
                   comment_length = le(cd, at + 32, 2);
    if (cd.size() - at - kHeaderSize < name_length + extra_length + comment_length)
      corrupt(fmt::format("central directory header {} of {} (at offset {}) runs past the central directory", i + 1,
                          entries, cd_offset + at));
    const std::string name = cd.substr(at + kHeaderSize, name_length);
    // The zip64 extra field holds, in this order, each of the three values saturated above.
    const std::string_view extra = std::string_view(cd).substr(at + kHeaderSize + name_length, extra_length);
    for (size_t e = 0; e + 4 <= extra.size();) {
      const uint64_t id = le(extra, e, 2), length = le(extra, e + 2, 2);
      if (length > extra.size() - e - 4)
        corrupt(fmt::format("record '{}' has an extra field that runs past its header", name));
      if (id == 1) {
        size_t f = e + 4;
        for (uint64_t* value : {&uncompressed, &compressed, &local}) {
          if (*value != 0xFFFFFFFF) continue;
          if (f + 8 > e + 4 + length)
            corrupt(fmt::format("record '{}' has a zip64 extra field that is too short", name));
          *value = le(extra, f, 8);
          f += 8;
        }
      }
      e += 4 + length;
    }
    at += kHeaderSize + name_length + extra_length + comment_length;

    // The record: a local header (30 bytes, its own name and extra field), then the data, all
    // before the central directory.
    constexpr uint64_t kLocalSize = 30;
    const std::string local_header = local <= cd_offset ? read_at(local, kLocalSize) : std::string();
    if (local_header.size() < kLocalSize || local_header.compare(0, 4, "PK\x03\x04", 4) != 0)
      corrupt(fmt::format("record '{}' has no local header at offset {}", name, local));
    const uint64_t data_offset = local + kLocalSize + le(local_header, 26, 2) + le(local_header, 28, 2);
    if (data_offset > cd_offset || compressed > cd_offset - data_offset)
      corrupt(
          fmt::format("record '{}' ({} bytes at offset {}) runs past the start of the central directory at "
                      "offset {}",
                      name, compressed, data_offset, cd_offset));
    if (method == 0 && uncompressed != compressed)
      corrupt(fmt::format("record '{}' is stored uncompressed but declares {} bytes in {} bytes of data", name,
                          uncompressed, compressed));
    if (method == 8 && uncompressed > max_inflated_size(compressed))
      corrupt(fmt::format("record '{}' declares {} bytes, more than its {} compressed bytes can hold", name,
                          uncompressed, compressed));
    if (method != 0 && method != 8)
      corrupt(fmt::format("record '{}' uses zip compression method {} (PyTorch archives are stored or deflated)", name,
                          method));
  }
}

// A checkpoint for object storage is serialized into a local temporary file first (the same
// streaming writer), then handed to the storage in one write, which is atomic there (one PUT, or
// a multipart upload completed last): a half-written checkpoint is never listed.
std::string local_temporary(std::string_view what) {
  static std::atomic<uint64_t> counter{0};
  const char* tmp = std::getenv("TMPDIR");
  return fmt::format("{}/.fulgur-{}-{}-{}", tmp && *tmp ? tmp : "/tmp", what, ::getpid(), counter.fetch_add(1));
}

// Removes a local temporary file when it goes out of scope.
struct TemporaryFile {
  std::string path;
  ~TemporaryFile() { ::unlink(path.c_str()); }
};

// `message` with every mention of the temporary file replaced by the URL the user gave.
std::string with_url(std::string message, const std::string& temporary, const std::string& url) {
  for (size_t at = message.find(temporary); at != std::string::npos; at = message.find(temporary, at + url.size()))
    message.replace(at, temporary.size(), url);
  return message;
}

}  // namespace

void write_checkpoint_file(const c10::IValue& checkpoint, const std::string& path) {
  if (is_storage_url(path)) {
    Storage& storage = storage_for(path);
    const TemporaryFile temporary{local_temporary("upload")};
    try {
      write_checkpoint_file(checkpoint, temporary.path);
    } catch (const Error& e) {
      throw Error(e.kind(), with_url(e.what(), temporary.path, path));
    }
    storage.write(path, local_storage().read(temporary.path));
    return;
  }
  // Pickling first, before any file exists: the pickle refers to tensors by storage id and is
  // small; the storages themselves are streamed below.
  std::vector<char> pickle_bytes;
  std::vector<at::Tensor> storages;
  try {
    const c10::IValue plain = detail::plain_containers(checkpoint);
    // tensor_table = nullptr: tensors become torch.save-style persistent storage ids;
    // tag_aggregates = false: no torch.jit type tags (see the top of this file).
    torch::jit::Pickler pickler(
        [&](const char* data, size_t size) { pickle_bytes.insert(pickle_bytes.end(), data, data + size); },
        /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
        /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
        /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(plain);
    pickler.stop();
    storages = pickler.tensorData();
  } catch (const c10::Error& e) {
    throw Error(ErrorKind::checkpoint, fmt::format("cannot write checkpoint '{}': its content cannot be serialized: {}",
                                                   path, torch_reason(e)));
  }

  AtomicFile file(path, "checkpoint");
  file.arm(fault_for_this_write());
  try {
    caffe2::serialize::PyTorchStreamWriter writer([&file](const void* data, size_t size) -> size_t {
      // Always "succeeds": a short count would make the writer's destructor throw (terminate).
      // The real outcome is kept in `file` and checked by commit().
      file.write(data, size);
      return size;
    });
    // The records torch::jit::writeArchiveAndTensors writes, in the same order.
    for (size_t i = 0; i < storages.size() && !file.failed(); ++i) {
      const torch::jit::WriteableTensorData data = torch::jit::getWriteableTensorData(storages[i]);
      writer.writeRecord(fmt::format("data/{}", i), data.data(), data.sizeInBytes());
    }
    if (!file.failed()) writer.writeRecord("data.pkl", pickle_bytes.data(), pickle_bytes.size());
    if (!file.failed()) writer.writeEndOfFile();
  } catch (const c10::Error& e) {
    file.fail(ErrorKind::checkpoint, fmt::format("serializing it failed: {}", torch_reason(e)), 0);
  }
  file.commit();
}

c10::IValue read_checkpoint_file(const std::string& path, c10::Device map_location) {
  if (is_storage_url(path)) {
    Storage& storage = storage_for(path);
    const TemporaryFile temporary{local_temporary("download")};
    atomic_write_text(temporary.path, storage.read(path));
    try {
      return read_checkpoint_file(temporary.path, map_location);
    } catch (const Error& e) {
      throw Error(e.kind(), with_url(e.what(), temporary.path, path));
    }
  }
  check_archive_framing(path);
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    if (reader.hasRecord("data.pkl")) {
      auto [record, size] = reader.getRecord("data.pkl");
      const std::string_view pickle(static_cast<const char*>(record.get()), size);
      if (std::string problem = detail::pickle_memo_problem(pickle); !problem.empty())
        unreadable(path, fmt::format("the archive is corrupt: {}", problem));
      // Python's OrderedDicts (every state_dict()) need the rewrite; then this is what
      // readArchiveAndTensors does, over the rewritten pickle.
      if (std::optional<std::string> fixed = detail::plain_dicts_for_ordered_dicts(pickle)) {
        size_t read = 0;
        auto next = [&](char* buffer, size_t length) -> size_t {
          length = std::min(length, fixed->size() - read);
          std::memcpy(buffer, fixed->data() + read, length);
          read += length;
          return length;
        };
        auto record = [&](const std::string& name) { return std::get<0>(reader.getRecord("data/" + name)); };
        torch::jit::Unpickler unpickler(next, nullptr, nullptr, record, map_location);
        unpickler.set_version(reader.version());
        return unpickler.parse_ivalue();
      }
    }
    // What torch::pickle_load does, reading records from the file instead of a buffer holding
    // all of it, and placing tensors on `map_location`.
    return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                             /*type_resolver=*/std::nullopt, /*obj_loader=*/std::nullopt, map_location,
                                             reader);
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    unreadable(path, fmt::format("the archive is corrupt or is not a checkpoint: {}", torch_reason(e)));
  } catch (const std::exception& e) {
    unreadable(path, fmt::format("the archive is corrupt or is not a checkpoint: {}", e.what()));
  }
}

void atomic_write_text(const std::string& path, std::string_view content) {
  if (is_storage_url(path)) return storage_for(path).write(path, content);
  AtomicFile file(path, "file");
  file.write(content.data(), content.size());
  file.commit();
}

std::optional<int64_t> checkpoint_completed_ns(const std::string& path) {
  if (is_storage_url(path)) {
    const std::optional<StorageObject> object = storage_for(path).stat(path);
    return object ? std::optional<int64_t>(object->modified_ns) : std::nullopt;
  }
  struct stat info {};
  if (path.empty() || ::stat(path.c_str(), &info) != 0) return std::nullopt;
  if (S_ISDIR(info.st_mode)) {
    if (!dcp::is_distributed_checkpoint(path) || ::stat((path + "/.metadata").c_str(), &info) != 0) return std::nullopt;
  } else if (!S_ISREG(info.st_mode)) {
    return std::nullopt;
  }
  return info.st_mtim.tv_sec * 1'000'000'000LL + info.st_mtim.tv_nsec;
}

}  // namespace fulgur
