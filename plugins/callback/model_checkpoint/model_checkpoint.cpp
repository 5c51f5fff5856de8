// Built-in callback `model_checkpoint`: Lightning's ModelCheckpoint. Saves at epoch ends (after
// validation) or every N optimizer steps, keeps the best `save_top_k` files by a monitored metric
// and deletes the ones that fall out, optionally keeps `last.ckpt`, and records best/last paths in
// its state. It is the Trainer's checkpoint provider: ckpt_path = "best" / "last" ask it, and a new
// process finds the newest last*.ckpt where it saves.
#include <fulgur/checkpoint_io.h>
#include <fulgur/checkpoint_queue.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/plugin.h>
#include <fulgur/storage.h>
#include <fulgur/storage_root.h>

#include "../common/callback_conventions.h"

#include <fmt/format.h>

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace support = fulgur::callback_conventions;
using fulgur::Error;
using fulgur::ErrorKind;
using support::MonitorMode;

constexpr char kOwner[] = "callback 'model_checkpoint'";
constexpr char kDefaultFilename[] = "{epoch}-{step}";
constexpr char kLastFilename[] = "last";
constexpr char kExtension[] = ".ckpt";

// A value a filename placeholder or the monitor can name. epoch and step are integers so that
// "{epoch}" renders "epoch=3", not "epoch=3.0".
struct Candidate {
  double value = 0;
  bool integral = false;
};
using Candidates = std::map<std::string, Candidate, std::less<>>;

// Formats like Python's format(value, spec), which Lightning applies to its metric tensors.
std::string format_candidate(const Candidate& candidate, std::string_view spec, std::string_view filename) {
  try {
    if (spec.empty())
      return candidate.integral ? fmt::format("{}", static_cast<int64_t>(candidate.value))
                                : support::python_float_repr(candidate.value);
    char type = spec.back();
    if (type == '%') {  // fmt has no '%': Python's is 'f' of the value times 100, then '%'
      std::string fixed(spec.substr(0, spec.size() - 1));
      return fmt::format(fmt::runtime("{:" + fixed + "f}"), candidate.value * 100.0) + "%";
    }
    std::string pattern = fmt::format("{{:{}}}", spec);
    bool float_type = std::strchr("eEfFgGaA", type) != nullptr;
    if (candidate.integral && !float_type)
      return fmt::format(fmt::runtime(pattern), static_cast<int64_t>(candidate.value));
    // Python refuses "d" for floats; a filename is not worth stopping a run for, so round instead.
    if (!candidate.integral && (type == 'd' || type == 'x' || type == 'o' || type == 'b') &&
        std::isfinite(candidate.value))
      return fmt::format(fmt::runtime(pattern), static_cast<int64_t>(std::llround(candidate.value)));
    return fmt::format(fmt::runtime(pattern), candidate.value);
  } catch (const fmt::format_error& e) {
    throw Error(ErrorKind::config, fmt::format("{}: filename = \"{}\": the format spec \"{}\" is not valid ({}); "
                                               "use Python-style specs such as \"{{epoch:02d}}\" or "
                                               "\"{{val/loss:.4f}}\"",
                                               kOwner, filename, spec, e.what()));
  }
}

// Lightning's _format_checkpoint_name: "{epoch}-{val/acc:.4f}" -> "epoch=3-val_acc=0.9123". A '/'
// in a metric name would make a subdirectory, so names are written with '_' instead.
std::string render_filename(std::string_view filename, const Candidates& candidates, bool auto_insert_metric_name) {
  std::string out;
  for (size_t i = 0; i < filename.size();) {
    char c = filename[i];
    if ((c == '{' || c == '}') && i + 1 < filename.size() && filename[i + 1] == c) {  // escaped brace
      out += c;
      i += 2;
      continue;
    }
    if (c == '}')
      throw Error(ErrorKind::config, fmt::format("{}: filename = \"{}\" has a '}}' without its '{{' (write '}}}}' "
                                                 "for a literal brace)",
                                                 kOwner, std::string(filename)));
    if (c != '{') {
      out += c;
      ++i;
      continue;
    }
    size_t close = filename.find('}', i);
    if (close == std::string_view::npos)
      throw Error(ErrorKind::config,
                  fmt::format("{}: filename = \"{}\" has a '{{' without its '}}'", kOwner, std::string(filename)));
    std::string_view field = filename.substr(i + 1, close - i - 1);
    if (field.find('{') != std::string_view::npos)
      throw Error(ErrorKind::config,
                  fmt::format("{}: filename = \"{}\" has a '{{' without its '}}'", kOwner, std::string(filename)));
    size_t colon = field.find(':');
    std::string_view name = field.substr(0, colon);
    std::string_view spec = colon == std::string_view::npos ? std::string_view{} : field.substr(colon + 1);
    auto found = candidates.find(name);
    // As in Lightning, a placeholder for a metric that is not logged (yet) renders as 0.
    Candidate value = found != candidates.end() ? found->second : Candidate{0, true};
    if (auto_insert_metric_name) {
      for (char n : name) out += n == '/' ? '_' : n;
      out += '=';
    }
    out += format_candidate(value, spec, filename);
    i = close + 1;
  }
  return out;
}

std::string expand_user(const std::string& path) {
  if (path == "~" || path.starts_with("~/")) {
    if (const char* home = std::getenv("HOME")) return std::string(home) + path.substr(1);
  }
  return path;
}

// Disk access goes through POSIX, not std::filesystem: libtorch.so exports its own (GCC 13) copies
// of several std::filesystem functions, and remove_all among them crashes with Debian 12's
// libstdc++ (see tests/test_support.h). Only the lexical path operations are used here.
//
// A URL (s3://bucket/prefix, fulgur/storage.h) is kept as it is, less a trailing '/'; its files are
// reached through fulgur::storage_for().
std::string absolute_path(const std::string& path) {
  if (fulgur::is_storage_url(path)) {
    std::string url = path;
    while (url.ends_with('/') && !url.ends_with("://")) url.pop_back();
    return url;
  }
  fs::path p(expand_user(path));
  if (p.is_relative()) {
    std::string cwd(PATH_MAX, '\0');
    if (::getcwd(cwd.data(), cwd.size()) != nullptr) p = fs::path(cwd.c_str()) / p;
  }
  std::string normal = p.lexically_normal().string();
  if (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  return normal;
}

// On object storage a sharded (DCP) checkpoint is a prefix whose .metadata, written last, marks it complete.
constexpr const char* kDcpMetadata = ".metadata";

bool path_exists(const std::string& path) {
  if (fulgur::is_storage_url(path)) {
    fulgur::Storage& storage = fulgur::storage_for(path);
    return storage.exists(path) || storage.exists(fulgur::join_storage_path(path, kDcpMetadata));
  }
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

bool directory_has_entries(const std::string& path) {
  if (fulgur::is_storage_url(path)) return !fulgur::storage_for(path).list(fulgur::join_storage_path(path, "")).empty();
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return false;
  bool found = false;
  while (const dirent* entry = ::readdir(dir)) {
    if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) {
      found = true;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

// Removes a file, or a directory with its contents (sharded checkpoints are directories).
// Returns 0 or the errno of the first failure.
int remove_tree(const std::string& path) {
  static thread_local int first_error = 0;
  first_error = 0;
  int rc = ::nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, FTW*) {
        if (std::remove(file) != 0 && first_error == 0) first_error = errno;
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0 && first_error == 0) first_error = errno;
  return first_error;
}

// True when `file` lies somewhere below `directory`. Both are compared as absolute, lexically
// normalized paths, the form in which this callback composes every path it writes.
bool is_inside(const std::string& file, const std::string& directory) {
  if (fulgur::is_storage_url(file) || fulgur::is_storage_url(directory))
    return file.starts_with(fulgur::join_storage_path(absolute_path(directory), "")) &&
           file.size() > absolute_path(directory).size() + 1;
  fs::path f(absolute_path(file));
  fs::path d(absolute_path(directory));
  auto [d_end, f_it] = std::mismatch(d.begin(), d.end(), f.begin(), f.end());
  return d_end == d.end() && f_it != f.end();
}

// The ranking bookkeeping; copied before a save so that a failed write leaves it unchanged.
struct TopK {
  std::vector<std::pair<std::string, double>> best_k_models;  // insertion order, as Python's dict
  std::string best_model_path;
  std::optional<double> best_model_score;
  std::optional<double> current_score;
  std::string kth_best_model_path;
  double kth_value = 0;
  std::string last_model_path;

  const double* score_of(const std::string& path) const {
    for (const auto& [p, s] : best_k_models)
      if (p == path) return &s;
    return nullptr;
  }
  void erase(const std::string& path) {
    std::erase_if(best_k_models, [&](const auto& entry) { return entry.first == path; });
  }
  void assign(const std::string& path, double score) {
    for (auto& [p, s] : best_k_models)
      if (p == path) {
        s = score;
        return;
      }
    best_k_models.emplace_back(path, score);
  }
  // Python's min()/max() over the dict: the first entry wins a tie.
  const std::pair<std::string, double>& extreme(bool want_max) const {
    const auto* best = &best_k_models.front();
    for (const auto& entry : best_k_models)
      if (want_max ? entry.second > best->second : entry.second < best->second) best = &entry;
    return *best;
  }
};

// A checkpoint's state, kept until on_fit_start() knows this run's directory (Lightning compares them).
struct LoadedState {
  TopK top_k;
  std::optional<std::string> dirpath;
};

enum class Trigger { train_step, train_epoch_end, validation_end };

// The newest regular file named last*.ckpt directly in `directory`, or, with `checkpoints_below`,
// in any directory named "checkpoints" below it (where <log_dir>/checkpoints lands for every
// logger version). Empty when there is none. POSIX only, as above.
std::string newest_last_checkpoint(const std::string& directory, bool checkpoints_below) {
  if (fulgur::is_storage_url(directory)) {
    // Object stores list what is complete: an upload appears only when it has finished.
    std::string newest;
    int64_t newest_time = 0;
    for (const fulgur::StorageObject& object :
         fulgur::storage_for(directory).list(fulgur::join_storage_path(directory, ""))) {
      std::string url = object.url;
      if (url.ends_with(std::string("/") + kDcpMetadata)) url.resize(url.size() - std::strlen(kDcpMetadata) - 1);
      const size_t slash = url.rfind('/');
      const std::string name = url.substr(slash + 1), parent = url.substr(0, slash);
      if (!name.starts_with(kLastFilename) || !name.ends_with(kExtension)) continue;
      const bool wanted = checkpoints_below ? parent.ends_with("/checkpoints") : parent == directory;
      if (wanted && (newest.empty() || object.modified_ns > newest_time)) {
        newest = url;
        newest_time = object.modified_ns;
      }
    }
    return newest;
  }
  struct Search {
    std::string newest;
    int64_t newest_time = 0;
    bool checkpoints_below = false;
    std::string top;
  };
  static thread_local Search search;
  search = Search{};
  search.checkpoints_below = checkpoints_below;
  search.top = directory;
  ::nftw(
      directory.c_str(),
      [](const char* file, const struct stat*, int type, FTW* ftw) {
        // A file, or a distributed checkpoint's directory (a sharded strategy's save).
        if (type != FTW_F && type != FTW_D) return 0;
        const std::string path(file);
        const std::string name = path.substr(static_cast<size_t>(ftw->base));
        if (ftw->level == 0 || !name.starts_with(kLastFilename) || !name.ends_with(kExtension)) return 0;
        const std::string parent = fs::path(path).parent_path().string();
        const bool wanted = search.checkpoints_below ? fs::path(parent).filename() == "checkpoints" : ftw->level == 1;
        if (!wanted) return 0;
        const std::optional<int64_t> t = fulgur::checkpoint_completed_ns(path);
        if (t && (search.newest.empty() || *t > search.newest_time)) {
          search.newest = path;
          search.newest_time = *t;
        }
        return 0;
      },
      16, FTW_PHYS);
  return search.newest;
}

class ModelCheckpoint final : public fulgur::Callback, public fulgur::CheckpointProvider {
 public:
  FULGUR_OPTIONS(Options,
                 (string, dirpath, "Directory for checkpoints; empty: <log_dir>/checkpoints (rank zero's)", ""),
                 (string, filename,
                  "File name template without .ckpt: {epoch}, {step} and logged metrics, with Python format "
                  "specs, e.g. \"{epoch}-{val/acc:.4f}\" -> epoch=3-val_acc=0.9123",
                  "{epoch}-{step}"),
                 (string, monitor, "Logged metric that ranks checkpoints; empty: keep the latest", ""),
                 (string, mode, "\"min\" (lower monitor is better) or \"max\"", "min"),
                 (integer, save_top_k, "How many best checkpoints to keep; -1 all, 0 none", 1),
                 (boolean, save_last, "Also keep last.ckpt, rewritten at every save point", false),
                 (integer, every_n_train_steps, "Save every N optimizer steps; 0 off", 0),
                 (integer, every_n_epochs,
                  "Save every N epochs; 0 off; -1: 1, or 0 when every_n_train_steps is set (Lightning's default)", -1),
                 (boolean, save_on_train_epoch_end,
                  "Save at the end of the training epoch instead of after validation (always so without "
                  "validation)",
                  false),
                 (boolean, save_weights_only, "Write only the model weights (no optimizer, loops, callbacks)", false),
                 (boolean, auto_insert_metric_name, "Write \"name=\" before each placeholder's value", true),
                 (boolean, enable_version_counter,
                  "Append -v1, -v2, ... instead of overwriting a file of the same name", true),
                 (boolean, verbose, "Log every save decision", false));

  explicit ModelCheckpoint(const Options& options)
      : dirpath_option_(options.dirpath),
        filename_(options.filename.empty() ? kDefaultFilename : options.filename),
        monitor_(options.monitor),
        mode_(support::parse_mode(kOwner, options.mode)),
        save_top_k_(options.save_top_k),
        save_last_(options.save_last),
        every_n_train_steps_(options.every_n_train_steps),
        every_n_epochs_(options.every_n_epochs),
        save_on_train_epoch_end_(options.save_on_train_epoch_end),
        save_weights_only_(options.save_weights_only),
        auto_insert_metric_name_(options.auto_insert_metric_name),
        enable_version_counter_(options.enable_version_counter),
        verbose_(options.verbose) {
    validate_configuration(options);
    // Lightning's rule: epoch-triggered saving is on by default, off when saving by steps.
    if (every_n_epochs_ == -1) every_n_epochs_ = every_n_train_steps_ > 0 ? 0 : 1;
    top_k_.kth_value = support::worst_score(mode_);
  }

  // on_train_batch_end is declared only when step-triggered saving is on (see hooks()).
  static constexpr fulgur::HookSet kConditionalHooks = static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_end);

  fulgur::HookSet hooks() const override {
    fulgur::HookSet set = fulgur::Hook::setup | fulgur::Hook::teardown | fulgur::Hook::fit_start |
                          fulgur::Hook::train_epoch_end | fulgur::Hook::validation_end;
    // The per-batch hook only when it can do something: it is on the hot path.
    if (every_n_train_steps_ > 0) set = set | fulgur::Hook::train_batch_end;
    return set;
  }

  // Saves after the other callbacks have run (checkpoint), and decides from monitored metrics, so
  // its epoch-end save sees what the Module logs in on_train_epoch_end (monitor).
  fulgur::CallbackRoles roles() const override {
    return fulgur::CallbackRole::checkpoint | fulgur::CallbackRole::monitor;
  }
  fulgur::CheckpointProvider* checkpoint_provider() override { return this; }

  // ---- CheckpointProvider: what ckpt_path = "best" / "last" resolve to ----------------------------
  std::string best_checkpoint_path(fulgur::TrainerContext& trainer) override {
    const TopK& known = pending_ ? pending_->top_k : top_k_;
    std::string path = known.best_model_path;
    // A new process (`fulgur test --ckpt_path=best` after `fulgur fit`): the best checkpoint that
    // the newest last*.ckpt where this callback saves recorded in its state.
    if (path.empty() && trainer.is_global_zero()) path = best_recorded_in_last(trainer);
    return agreed_existing(trainer, path);
  }

  std::string last_checkpoint_path(fulgur::TrainerContext& trainer) override {
    // Saved in this process (or recorded in the state it was restored from) and still on disk...
    const TopK& known = pending_ ? pending_->top_k : top_k_;
    std::string path = trainer.is_global_zero() && !known.last_model_path.empty() && path_exists(known.last_model_path)
                           ? known.last_model_path
                           : std::string();
    // ... or the newest last*.ckpt where this callback saves: a new process resuming a killed run.
    if (path.empty() && trainer.is_global_zero()) {
      const auto [directory, below] = search_location(trainer);
      if (fulgur::is_storage_url(directory) || path_exists(directory)) path = newest_last_checkpoint(directory, below);
    }
    return trainer.broadcast(path, 0);  // every rank resumes from rank zero's choice
  }

  std::string describe_location(fulgur::TrainerContext& trainer) override {
    const auto [directory, below] = search_location(trainer);
    return below ? fmt::format("{}/**/checkpoints/last*.ckpt", directory) : fmt::format("{}/last*.ckpt", directory);
  }

  void setup(fulgur::TrainerContext&, fulgur::Stage stage) override {
    fitting_ = stage == fulgur::Stage::fit;
    validation_ran_ = false;
    deferred_save_ = false;
  }

  // The directory is resolved here rather than in setup(): the loggers that define log_dir() may
  // only be ready once the strategy has set up, which comes after the setup hook.
  void on_fit_start(fulgur::TrainerContext& trainer) override {
    std::string dirpath = dirpath_option_;
    if (dirpath.empty()) {
      // The run directory's checkpoints/, on object storage when default_root_dir is a URL (below
      // it, where search_location looks for "last").
      const auto* root = fulgur::find_extension<fulgur::StorageRoot>(trainer);
      const std::string log_url = root && !root->default_root_url().empty() ? root->log_url() : std::string();
      dirpath = log_url.empty() ? (fs::path(trainer.log_dir()) / "checkpoints").string()
                                : fulgur::join_storage_path(log_url, "checkpoints");
    }
    // Rank zero's choice for everyone: log_dir() may hold a version number each process picked.
    dirpath_ = trainer.broadcast(absolute_path(dirpath), 0);
    if (pending_) apply_loaded_state(*std::exchange(pending_, std::nullopt));
    if (save_top_k_ != 0 && trainer.is_global_zero()) warn_if_directory_not_empty();
  }

  void teardown(fulgur::TrainerContext&, fulgur::Stage) override { fitting_ = false; }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    if (trainer.global_step() % every_n_train_steps_ != 0 || should_skip_saving(trainer)) return;
    Candidates candidates = monitor_candidates(trainer);
    if (!monitor_.empty() && !candidates.contains(monitor_)) {
      // Lightning 2.5.5+: a step-triggered save waits for validation to log the monitored metric
      // instead of ranking by a stale or missing value.
      if (validation_expected(trainer)) {
        deferred_save_ = true;
        return;
      }
      throw support::missing_metric_error(kOwner, monitor_, keys_of(candidates));
    }
    save_top_k(trainer, candidates, Trigger::train_step);
    save_last(trainer, candidates);
  }

  void on_validation_end(fulgur::TrainerContext& trainer) override {
    if (trainer.sanity_checking() || !fitting_) return;
    validation_ran_ = true;
    bool deferred = std::exchange(deferred_save_, false);
    if (should_skip_saving(trainer)) return;
    if (deferred) {
      Candidates candidates = monitor_candidates(trainer);
      save_top_k(trainer, candidates, Trigger::validation_end);
      save_last(trainer, candidates);
      return;
    }
    if (save_on_train_epoch_end_) return;
    save_for_epoch(trainer, Trigger::validation_end);
  }

  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    if (should_skip_saving(trainer)) return;
    // Saving after validation sees the validation metrics; without validation in this run there
    // is no such moment, so the epoch end is the only place to save (Lightning does the same).
    if (!save_on_train_epoch_end_ && validation_expected(trainer)) return;
    save_for_epoch(trainer, Trigger::train_epoch_end);
  }

  std::string state_key() const override {
    return fmt::format(
        "ModelCheckpoint{{'monitor': {}, 'mode': '{}', 'every_n_train_steps': {}, 'every_n_epochs': {}, "
        "'train_time_interval': None}}",
        support::python_repr_or_none(monitor_), support::to_string(mode_), every_n_train_steps_, every_n_epochs_);
  }

  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    auto none_if_empty = [](const std::string& s) { return s.empty() ? c10::IValue() : c10::IValue(s); };
    state.insert("monitor", none_if_empty(monitor_));
    state.insert("best_model_score", support::optional_score_value(top_k_.best_model_score));
    state.insert("best_model_path", top_k_.best_model_path);
    state.insert("current_score", support::optional_score_value(top_k_.current_score));
    state.insert("dirpath", none_if_empty(dirpath_));
    c10::impl::GenericDict best_k(c10::StringType::get(), c10::TensorType::get());
    for (const auto& [path, score] : top_k_.best_k_models) best_k.insert(path, support::score_value(score));
    state.insert("best_k_models", best_k);
    state.insert("kth_best_model_path", top_k_.kth_best_model_path);
    state.insert("kth_value", support::score_value(top_k_.kth_value));
    state.insert("last_model_path", top_k_.last_model_path);
    out = c10::IValue(state);
  }

  void load_state_dict(const c10::IValue& state) override {
    const auto dict = support::expect_dict(kOwner, state);
    LoadedState loaded;
    loaded.dirpath = support::get_optional_string(kOwner, dict, "dirpath");
    TopK& t = loaded.top_k;
    t.best_model_path = support::get_optional_string(kOwner, dict, "best_model_path").value_or("");
    t.best_model_score = support::get_optional_double(kOwner, dict, "best_model_score");
    t.current_score = support::get_optional_double(kOwner, dict, "current_score");
    t.kth_best_model_path = support::get_optional_string(kOwner, dict, "kth_best_model_path").value_or("");
    t.kth_value = support::get_optional_double(kOwner, dict, "kth_value").value_or(support::worst_score(mode_));
    t.last_model_path = support::get_optional_string(kOwner, dict, "last_model_path").value_or("");
    if (auto best_k = support::find_value(dict, "best_k_models"); best_k && best_k->isGenericDict()) {
      for (const auto& entry : best_k->toGenericDict()) {
        if (!entry.key().isString()) continue;
        const std::string& path = entry.key().toStringRef();
        if (auto score = support::to_optional_double(kOwner, "best_k_models", entry.value()))
          t.best_k_models.emplace_back(path, *score);
      }
    }
    // Restored before on_fit_start knows this run's directory, which the check below compares with.
    if (dirpath_.empty())
      pending_ = std::move(loaded);
    else
      apply_loaded_state(std::move(loaded));
  }

 private:
  void validate_configuration(const Options& options) const {
    options.check(save_top_k_ >= -1, "save_top_k",
                  "is not valid; use -1 (keep all), 0 (save none) or k >= 1 (keep the best k by `monitor`)");
    options.check(!(monitor_.empty() && save_top_k_ > 1), "save_top_k",
                  "needs a `monitor` to rank checkpoints by; set monitor = \"val/loss\" (for example), or use "
                  "save_top_k = 1 (keep the latest) or -1 (keep all)");
    options.check(every_n_train_steps_ >= 0, "every_n_train_steps", "must be >= 0 (0 turns step-triggered saving off)");
    options.check(every_n_epochs_ >= -1, "every_n_epochs",
                  "must be >= 0 (0 turns epoch-triggered saving off) or -1 (automatic)");
    // Render once with placeholder values so a malformed template fails at startup, not after an epoch.
    Candidates sample{{"epoch", {0, true}}, {"step", {0, true}}};
    render_filename(filename_, sample, auto_insert_metric_name_);
  }

  // Lightning's _should_skip_saving_checkpoint: only while fitting, never in the sanity check,
  // and never twice for the same optimizer step (nor at step 0, before any training).
  bool should_skip_saving(fulgur::TrainerContext& trainer) const {
    return !fitting_ || trainer.sanity_checking() || last_global_step_saved_ == trainer.global_step();
  }

  static bool validation_expected(fulgur::TrainerContext& trainer) {
    return trainer.num_batches(fulgur::Stage::validate) != 0;
  }

  void save_for_epoch(fulgur::TrainerContext& trainer, Trigger trigger) {
    Candidates candidates = monitor_candidates(trainer);
    if (every_n_epochs_ >= 1 && (trainer.current_epoch() + 1) % every_n_epochs_ == 0)
      save_top_k(trainer, candidates, trigger);
    save_last(trainer, candidates);
  }

  Candidates monitor_candidates(fulgur::TrainerContext& trainer) const {
    Candidates candidates;
    for (const auto& [name, value] : trainer.callback_metrics()) candidates.emplace(name, Candidate{value, false});
    // A logged "epoch"/"step" wins, as an integer (Lightning casts it with .int()).
    auto counter = [&](const char* key, int64_t fallback) {
      auto it = candidates.find(key);
      if (it != candidates.end())
        it->second = Candidate{std::trunc(it->second.value), true};
      else
        candidates.emplace(key, Candidate{static_cast<double>(fallback), true});
    };
    counter("epoch", trainer.current_epoch());
    counter("step", trainer.global_step());
    return candidates;
  }

  static std::vector<std::string> keys_of(const Candidates& candidates) {
    std::vector<std::string> keys;
    for (const auto& [name, value] : candidates) keys.push_back(name);
    return keys;
  }

  void save_top_k(fulgur::TrainerContext& trainer, const Candidates& candidates, Trigger trigger) {
    if (save_top_k_ == 0) return;
    if (monitor_.empty()) {
      save_without_monitor(trainer, candidates);
      return;
    }
    auto found = candidates.find(monitor_);
    if (found == candidates.end()) {
      // At an epoch end before this run's first validation, a validation metric cannot be there
      // yet (validation every N epochs); Lightning warns and skips. Anywhere else it is a mistake.
      if (trigger == Trigger::train_epoch_end && !validation_ran_ && validation_expected(trainer)) {
        if (!warned_missing_before_validation_ && trainer.is_global_zero())
          fulgur::log::warn(
              fmt::format("{}: \"{}\" is not logged yet; no top-k checkpoint at the end of epoch {} (validation has "
                          "not run yet)",
                          kOwner, monitor_, trainer.current_epoch()));
        warned_missing_before_validation_ = true;
        return;
      }
      throw support::missing_metric_error(kOwner, monitor_, keys_of(candidates));
    }
    double current = found->second.value;
    if (check_monitor_top_k(trainer, current)) {
      update_best_and_save(trainer, current, candidates);
    } else if (verbose_ && trainer.is_global_zero()) {
      fulgur::log::info(fmt::format("Epoch {}, global step {}: '{}' was not in top {}", epoch_of(candidates),
                                    step_of(candidates), monitor_, save_top_k_));
    }
  }

  bool check_monitor_top_k(fulgur::TrainerContext& trainer, double current) const {
    if (save_top_k_ == -1) return true;
    if (static_cast<int64_t>(top_k_.best_k_models.size()) < save_top_k_) return true;
    const double* kth = top_k_.score_of(top_k_.kth_best_model_path);
    bool better = kth != nullptr && support::is_better(mode_, current, *kth);
    // Every rank must take the same branch: the save below is collective for sharded strategies.
    return trainer.agree(better, /*all=*/true);
  }

  void update_best_and_save(fulgur::TrainerContext& trainer, double current, const Candidates& candidates) {
    TopK before = top_k_;
    size_t k = save_top_k_ == -1 ? top_k_.best_k_models.size() + 1 : static_cast<size_t>(save_top_k_);
    std::string removed_path;
    if (top_k_.best_k_models.size() == k && k > 0) {
      removed_path = top_k_.kth_best_model_path;
      top_k_.erase(removed_path);
    }
    // A NaN score is stored as the worst possible one so that it never ranks as best.
    if (std::isnan(current)) current = support::worst_score(mode_);
    std::string filepath = unique_filepath(trainer, filename_, candidates, removed_path);
    top_k_.current_score = current;
    top_k_.assign(filepath, current);
    bool minimize = mode_ == MonitorMode::min;
    if (top_k_.best_k_models.size() == k) {
      const auto& kth = top_k_.extreme(/*want_max=*/minimize);
      top_k_.kth_best_model_path = kth.first;
      top_k_.kth_value = kth.second;
    }
    const auto& best = top_k_.extreme(/*want_max=*/!minimize);
    top_k_.best_model_path = best.first;
    top_k_.best_model_score = best.second;
    if (verbose_ && trainer.is_global_zero())
      fulgur::log::info(fmt::format(
          "Epoch {}, global step {}: '{}' reached {:.5f} (best {:.5f}), saving model to '{}' as top {}",
          epoch_of(candidates), step_of(candidates), monitor_, current, *top_k_.best_model_score, filepath, k));
    save_checkpoint(trainer, filepath, before);
    if (!removed_path.empty() && should_remove(removed_path, filepath)) remove_after_save(trainer, removed_path);
  }

  void save_without_monitor(fulgur::TrainerContext& trainer, const Candidates& candidates) {
    TopK before = top_k_;
    std::string filepath = unique_filepath(trainer, filename_, candidates, top_k_.best_model_path);
    std::string previous = std::exchange(top_k_.best_model_path, filepath);
    if (verbose_ && trainer.is_global_zero())
      fulgur::log::info(fmt::format("Epoch {}, global step {}: saving model to '{}'", epoch_of(candidates),
                                    step_of(candidates), filepath));
    save_checkpoint(trainer, filepath, before);
    if (save_top_k_ == 1 && !previous.empty() && should_remove(previous, filepath))
      remove_after_save(trainer, previous);
  }

  void save_last(fulgur::TrainerContext& trainer, const Candidates& candidates) {
    if (!save_last_) return;
    TopK before = top_k_;
    std::string filepath = unique_filepath(trainer, kLastFilename, candidates, top_k_.last_model_path);
    std::string previous = std::exchange(top_k_.last_model_path, filepath);
    save_checkpoint(trainer, filepath, before);
    if (!previous.empty() && should_remove(previous, filepath)) remove_after_save(trainer, previous);
  }

  std::string checkpoint_path(std::string_view filename, const Candidates& candidates, int64_t version) const {
    std::string name = render_filename(filename, candidates, auto_insert_metric_name_);
    if (version > 0) name += fmt::format("-v{}", version);
    name += kExtension;
    return (fs::path(dirpath_) / name).string();
  }

  // The rendered path, or "-v1", "-v2", ... when a file of that name exists (unless it is the one
  // being replaced), so that a rerun in the same directory never overwrites older checkpoints.
  std::string unique_filepath(fulgur::TrainerContext& trainer, std::string_view filename, const Candidates& candidates,
                              const std::string& replaced_path) const {
    std::string path = checkpoint_path(filename, candidates, 0);
    if (!enable_version_counter_) return path;
    for (int64_t version = 1; path != replaced_path && file_exists(trainer, path); ++version)
      path = checkpoint_path(filename, candidates, version);
    return path;
  }

  // Rank zero looks; the answer is broadcast so that every rank picks the same name.
  static bool file_exists(fulgur::TrainerContext& trainer, const std::string& path) {
    bool exists = trainer.is_global_zero() && path_exists(path);
    return trainer.broadcast(exists ? "1" : "0", 0) == "1";
  }

  // The state is updated before the write because it is part of what is written; a failed write
  // puts it back so that best/last never name a file that does not exist.
  void save_checkpoint(fulgur::TrainerContext& trainer, const std::string& filepath, const TopK& before) {
    // Every rank calls in, as with Lightning's trainer.save_checkpoint: the strategy decides who
    // writes (rank zero for replicated models, every rank for sharded ones).
    try {
      trainer.save_checkpoint(filepath, save_weights_only_);
    } catch (...) {
      top_k_ = before;
      throw;
    }
    last_global_step_saved_ = trainer.global_step();
  }

  // Only files in this callback's own directory are ever deleted (not, say, one resumed from).
  bool should_remove(const std::string& previous, const std::string& current) const {
    return previous != current && is_inside(previous, dirpath_);
  }

  // The checkpoint that `path` was replaced by may still be being written in the background
  // ([trainer] async_checkpoint): `path` goes once that save is complete, so that a process killed
  // meanwhile still has it. A host without CheckpointSaveQueue (SDK < 1.5) saves synchronously.
  static void remove_after_save(fulgur::TrainerContext& trainer, const std::string& path) {
    if (auto* queue = fulgur::find_extension<fulgur::CheckpointSaveQueue>(trainer))
      queue->after_pending_save([&trainer, path] { remove_checkpoint(trainer, path); });
    else
      remove_checkpoint(trainer, path);
  }

  static void remove_checkpoint(fulgur::TrainerContext& trainer, const std::string& path) {
    if (!trainer.is_global_zero()) return;
    if (fulgur::is_storage_url(path)) {
      try {
        fulgur::Storage& storage = fulgur::storage_for(path);
        if (!storage.remove(path)) {
          // A sharded checkpoint: incomplete (not listed as one) from its first removal on.
          storage.remove(fulgur::join_storage_path(path, kDcpMetadata));
          for (const fulgur::StorageObject& object : storage.list(fulgur::join_storage_path(path, "")))
            storage.remove(object.url);
        }
      } catch (const fulgur::Error& e) {
        fulgur::log::warn(fmt::format("{}: could not delete {}, which is no longer kept: {}", kOwner, path, e.what()));
      }
      return;
    }
    if (int error = remove_tree(path); error != 0)
      fulgur::log::warn(
          fmt::format("{}: could not delete {}, which is no longer kept: {}", kOwner, path, std::strerror(error)));
  }

  void warn_if_directory_not_empty() const {
    if (directory_has_entries(dirpath_))
      fulgur::log::warn(fmt::format("{}: checkpoint directory {} exists and is not empty", kOwner, dirpath_));
  }

  void apply_loaded_state(LoadedState loaded) {
    std::string best_model_path = loaded.top_k.best_model_path;
    if (!loaded.dirpath || *loaded.dirpath == dirpath_) {
      top_k_ = std::move(loaded.top_k);
    } else {
      fulgur::log::warn(
          fmt::format("{}: the checkpoint directory changed from {} to {}, so best_model_score, kth_best_model_path, "
                      "kth_value, last_model_path and best_k_models are not restored; only best_model_path is",
                      kOwner, *loaded.dirpath, dirpath_));
    }
    top_k_.best_model_path = best_model_path;
  }

  // Where last*.ckpt files of earlier runs are: `dirpath` as configured, or, when it follows the
  // logger's versioned log_dir, every <...>/checkpoints directory under default_root_dir.
  std::pair<std::string, bool> search_location(fulgur::TrainerContext& trainer) const {
    if (!dirpath_option_.empty()) return {absolute_path(dirpath_option_), false};
    return {absolute_path(support::default_root(trainer)), true};
  }

  // best_model_path from the state this callback left in the newest last*.ckpt (empty if none).
  std::string best_recorded_in_last(fulgur::TrainerContext& trainer) const {
    const auto [directory, below] = search_location(trainer);
    if (!fulgur::is_storage_url(directory) && !path_exists(directory)) return {};
    const std::string last = newest_last_checkpoint(directory, below);
    if (last.empty()) return {};
    try {
      if (fulgur::dcp::is_distributed_checkpoint(last)) {
        // Only the one value, found by its place in the nesting: no tensor is read.
        const fulgur::dcp::Reader reader(last);
        const fulgur::dcp::Path wanted = {std::string("callbacks"), state_key(), std::string("best_model_path")};
        for (const std::string& key : reader.keys())
          if (!reader.is_tensor(key) && reader.path(key) == wanted) {
            const c10::IValue value = reader.read_value(key);
            return value.isString() ? value.toStringRef() : std::string();
          }
        return {};
      }
      const c10::IValue ckpt = fulgur::read_checkpoint_file(last);
      if (!ckpt.isGenericDict()) return {};
      const auto dict = ckpt.toGenericDict();
      if (!dict.contains("callbacks") || !dict.at("callbacks").isGenericDict()) return {};
      const auto callbacks = dict.at("callbacks").toGenericDict();
      if (!callbacks.contains(state_key())) return {};
      const c10::IValue state = callbacks.at(state_key());
      if (!state.isGenericDict()) return {};
      return support::get_optional_string(kOwner, state.toGenericDict(), "best_model_path").value_or("");
    } catch (const fulgur::Error& e) {
      fulgur::log::warn(
          fmt::format("{}: could not read the best checkpoint's path from {}: {}", kOwner, last, e.what()));
      return {};
    }
  }

  // `path` when rank zero sees it on disk, on every rank; empty otherwise.
  static std::string agreed_existing(fulgur::TrainerContext& trainer, const std::string& path) {
    const bool exists = trainer.is_global_zero() && !path.empty() && path_exists(path);
    return trainer.broadcast(exists ? path : std::string(), 0);
  }

  static int64_t epoch_of(const Candidates& c) { return static_cast<int64_t>(c.at("epoch").value); }
  static int64_t step_of(const Candidates& c) { return static_cast<int64_t>(c.at("step").value); }

  // Options.
  std::string dirpath_option_;
  std::string filename_;
  std::string monitor_;
  MonitorMode mode_;
  int64_t save_top_k_;
  bool save_last_;
  int64_t every_n_train_steps_;
  int64_t every_n_epochs_;
  bool save_on_train_epoch_end_;
  bool save_weights_only_;
  bool auto_insert_metric_name_;
  bool enable_version_counter_;
  bool verbose_;

  // State.
  std::string dirpath_;  // resolved in on_fit_start()
  TopK top_k_;
  std::optional<LoadedState> pending_;
  int64_t last_global_step_saved_ = 0;
  bool fitting_ = false;
  bool validation_ran_ = false;
  bool deferred_save_ = false;
  bool warned_missing_before_validation_ = false;
};

}  // namespace

FULGUR_PLUGIN(ModelCheckpoint, "model_checkpoint", "0.1.0",
              "Saves checkpoints by epoch or step, keeps the best k by a monitored metric and optionally last.ckpt")
