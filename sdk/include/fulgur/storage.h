/// @file
/// Where checkpoints live: a local directory or an object store, behind one small interface (the
/// role of Lightning's CheckpointIO over fsspec). A path is either a local path or a URL
/// `<scheme>://<bucket>/<key>`; storage_for() finds the Storage for it. `local` (POSIX files,
/// atomic temp + fsync + rename) is built in; other schemes (`s3`) come from storage plugins.
///
/// A storage plugin (SDK 1.5) is a class derived from Storage, described with FULGUR_PLUGIN like
/// every other plugin; its name is the URL scheme it serves, its options are the keys of the
/// config's `[storage]` table (`[storage] name = "s3"` selects whose options they are), and it
/// carries the ELF note and ABI checks of every plugin:
///
///   class MirrorStorage final : public fulgur::Storage { ... };
///   FULGUR_PLUGIN(MirrorStorage, "mirror", "1.0.0", "mirror://bucket/key under a local root",
///                 FULGUR_OPTION(path, root, "Directory that holds the buckets", nullptr))
///
/// The host creates it on the first URL of its scheme (options from `[storage]` when that names
/// it, else the schema's defaults) and hands it to register_storage(). Libraries written before
/// 1.5 with FULGUR_STORAGE_BACKEND (libfulgur-storage-SCHEME.so, no options, no note) still load.
///
/// write_checkpoint_file, read_checkpoint_file, checkpoint_completed_ns and atomic_write_text
/// (fulgur/checkpoint_io.h) accept such URLs, so every plugin that writes checkpoints through them
/// reaches object storage without knowing it.
#pragma once

#include <fulgur/export.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// One stored file (an object, for object stores).
struct StorageObject {
  std::string url;          ///< its full path or URL, as storage_for() accepts it
  uint64_t size = 0;        ///< bytes
  int64_t modified_ns = 0;  ///< when it was completed, nanoseconds since the epoch
};

/// Files addressed by path or URL. Every function throws fulgur::Error(ErrorKind::io) naming the
/// path (for object stores: bucket, key, the server's status and what to fix). Thread-safe: an
/// implementation may be used from several threads at once.
class FULGUR_SDK_API Storage {
 public:
  virtual ~Storage();
  /// Replaces the file at `url` with `bytes` atomically: readers see the old content or all of
  /// the new one, never a part (object stores: one PUT, or a multipart upload completed last).
  virtual void write(const std::string& url, std::string_view bytes) = 0;
  /// The whole file.
  virtual std::string read(const std::string& url) = 0;
  /// `length` bytes from `offset` (fewer at the end of the file).
  virtual std::string read_range(const std::string& url, uint64_t offset, uint64_t length) = 0;
  /// Every file whose URL starts with `prefix` (a "directory" ends it with '/'), in any order.
  virtual std::vector<StorageObject> list(const std::string& prefix) = 0;
  /// Removes the file; false when there was none.
  virtual bool remove(const std::string& url) = 0;
  /// The file's size and time, nullopt when there is none.
  virtual std::optional<StorageObject> stat(const std::string& url) = 0;
  /// True when the file exists.
  bool exists(const std::string& url) { return stat(url).has_value(); }
  /// Extension interfaces (fulgur/extension.h); none by default.
  virtual void* extension(std::string_view id) noexcept;
};

/// Creates the Storage of one scheme, once per process, on first use.
using StorageFactory = std::function<std::shared_ptr<Storage>()>;

/// True when `path` is a URL `<scheme>://...` (scheme: a letter, then letters, digits, '+', '-',
/// '.'), not a local path. `file://` counts as local: false.
FULGUR_SDK_API bool is_storage_url(std::string_view path);

/// The scheme of a URL ("s3" for "s3://bucket/key"); empty for a local path.
FULGUR_SDK_API std::string storage_scheme(std::string_view path);

/// Makes `scheme` available to storage_for(). A later registration of the same scheme replaces
/// the factory (the Storage already created, if any, stays in use).
FULGUR_SDK_API void register_storage(std::string_view scheme, StorageFactory factory);

/// What storage_for() calls once for a scheme that nobody registered, before it gives up: the
/// host's hook that loads the library providing it (the core's looks for
/// `libfulgur-storage-<scheme>.so` in the plugin search path).
FULGUR_SDK_API void set_storage_loader(std::function<void(std::string_view scheme)> loader);

/// The Storage for `path`: local_storage() for a local path, else the one registered for the URL's
/// scheme. Throws fulgur::Error(config) naming the scheme and the fix when none is.
FULGUR_SDK_API Storage& storage_for(std::string_view path);

/// The built-in storage for local paths (POSIX; write() is temp + fsync + rename + directory fsync).
FULGUR_SDK_API Storage& local_storage();

/// `base` + "/" + `name`, for local paths and URLs alike (std::filesystem would fold a URL's "//").
FULGUR_SDK_API std::string join_storage_path(std::string_view base, std::string_view name);

}  // namespace fulgur

/// Registers `Class` (default-constructible, derived from fulgur::Storage) for URLs of `Scheme`
/// when the library holding this line is loaded. Write it once, at namespace scope. The pre-1.5
/// way, kept for libraries built with it: such a library has no ELF note, so no options and no ABI
/// check before it runs. New storage libraries use FULGUR_PLUGIN (see the file comment).
#define FULGUR_STORAGE_BACKEND(Class, Scheme)                                                           \
  namespace {                                                                                           \
  [[gnu::used]] const bool fulgur_storage_registered_##Class = [] {                                     \
    ::fulgur::register_storage(Scheme, [] { return std::shared_ptr<::fulgur::Storage>(new Class()); }); \
    return true;                                                                                        \
  }();                                                                                                  \
  }
