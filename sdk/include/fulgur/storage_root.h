/// @file
/// Runs rooted on object storage (SDK 1.6): `[trainer] default_root_dir = "s3://bucket/prefix"`.
///
/// Plugins go on writing local files where they always did: TrainerContext::default_root_dir()
/// and log_dir() stay local directories (with a URL root, the run's staging directory,
/// `[trainer] staging_dir`), because a plugin built before 1.6 hands them to std::filesystem. Two
/// extensions tell a plugin that knows them where the run's files go on object storage:
///
///   - StorageRoot (of TrainerContext): the URL the run was given and the URL of its run
///     directory. A checkpoint callback writes there through fulgur/checkpoint_io.h, which takes
///     URLs:
///
///       std::string dir = trainer.log_dir();
///       if (auto* root = fulgur::find_extension<fulgur::StorageRoot>(trainer))
///         if (!root->default_root_url().empty()) dir = root->log_url();
///
///   - LoggerStorageRoot (of Logger): the host tells a logger the URL that its empty save_dir
///     stands for, before setup(), and asks it afterwards where its run directory is uploaded.
///     A logger without it keeps its files in the staging directory (the host warns once).
#pragma once

#include <string>
#include <string_view>

namespace fulgur {

/// Where a run's files go on object storage. Offered by the host's TrainerContext. SDK 1.6.
class StorageRoot {
 public:
  /// The extension's id (fulgur/extension.h). SDK 1.6.
  static constexpr std::string_view kExtensionId = "fulgur.trainer_context.storage_root/1";
  /// `[trainer] default_root_dir` when it is a URL (`s3://bucket/prefix`, as given); "" when the
  /// run's root is a local directory (TrainerContext::default_root_dir()). The same on every rank.
  /// Where a plugin's files go by default (a checkpoint written on an exception, predictions)
  /// when it is not empty. SDK 1.6.
  virtual std::string default_root_url() const = 0;
  /// The URL of the run directory: rank zero's first logger's upload directory
  /// (LoggerStorageRoot::remote_log_dir) when it lies below default_root_url() or the root is
  /// local; else, with a URL root, log_dir() moved from the staging directory to that URL
  /// (default_root_url() when there is no logger or log_dir() is elsewhere); else "" (the run
  /// directory is local: log_dir()). With a URL root, checkpoint callbacks put their files in
  /// `<log_url>/checkpoints` by default, below the root where `ckpt_path = "last"` looks. The same
  /// on every rank; before the loggers are set up (see TrainerContext::log_dir),
  /// default_root_url(). SDK 1.6.
  virtual std::string log_url() const = 0;

 protected:
  ~StorageRoot() = default;
};

/// A logger that writes to object storage. SDK 1.6.
class LoggerStorageRoot {
 public:
  /// The extension's id for Logger::extension(). SDK 1.6.
  static constexpr std::string_view kExtensionId = "fulgur.logger.storage_root/1";
  /// Called on every rank before setup(), only when `[trainer] default_root_dir` is a URL: a
  /// save_dir left empty means `url`. Files are then staged below LoggerSetup::root_dir (local) and
  /// uploaded below `url`, as for a save_dir that is a URL. SDK 1.6.
  virtual void set_root_url(const std::string& url) = 0;
  /// After setup(): the URL this logger's run directory (log_dir()) is uploaded to, or "" when its
  /// files stay local. SDK 1.6.
  virtual std::string remote_log_dir() const = 0;

 protected:
  ~LoggerStorageRoot() = default;
};

}  // namespace fulgur
