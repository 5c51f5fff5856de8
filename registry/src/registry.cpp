// Discovery (metadata only), checks, selection and loading of plugin libraries.
#include <fulgur/builtin_plugins.h>
#include <fulgur/host.h>
#include <fulgur/registry/crash_report.h>
#include <fulgur/registry/registry.h>
#include <fulgur/registry/verdicts.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <optional>
#include <set>

namespace fulgur {

namespace fs = std::filesystem;

std::string_view to_string(CandidateStatus status) {
  switch (status) {
    case CandidateStatus::available:
      return "available";
    case CandidateStatus::rejected:
      return "rejected";
    case CandidateStatus::shadowed:
      return "shadowed";
    case CandidateStatus::ambiguous:
      return "ambiguous";
  }
  return "unknown";
}

bool is_reserved_builtin_name(PluginKind kind, std::string_view name) {
  // The build generates the list from the built-in plugin targets (plugins/CMakeLists.txt).
  return std::any_of(std::begin(builtin::kReservedNames), std::end(builtin::kReservedNames),
                     [&](const builtin::Name& r) { return r.kind == kind && r.name == name; });
}

namespace {

bool valid_plugin_name(std::string_view name) {
  if (name.empty() || name.size() > 63) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
  });
}

bool looks_like_shared_library(const fs::path& file) {
  const std::string name = file.filename().string();
  return name.ends_with(".so") || name.find(".so.") != std::string::npos;
}

// Writable by someone other than the owner: anyone who can write it can run code in our process.
std::string writable_by_others(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  if (st.st_mode & S_IWOTH) return "writable by all users";
  if (st.st_mode & S_IWGRP) return "writable by its group";
  return {};
}

// Every field of the ABI tag that differs from the host's, "name: plugin X, host Y".
std::vector<std::string> abi_tag_differences(const fulgur_abi_tag& plugin, const fulgur_abi_tag& host) {
  std::vector<std::string> out;
  if (plugin.torch_major != host.torch_major || plugin.torch_minor != host.torch_minor)
    out.push_back(fmt::format("libtorch: plugin {}.{}, host {}.{}", plugin.torch_major, plugin.torch_minor,
                              host.torch_major, host.torch_minor));
  if (plugin.glibcxx_cxx11_abi != host.glibcxx_cxx11_abi)
    out.push_back(
        fmt::format("_GLIBCXX_USE_CXX11_ABI: plugin {}, host {}", plugin.glibcxx_cxx11_abi, host.glibcxx_cxx11_abi));
  if (plugin.stdlib != host.stdlib)
    out.push_back(fmt::format("C++ standard library: plugin {}, host {}",
                              plugin.stdlib == FULGUR_STDLIB_LIBCXX ? "libc++" : "libstdc++",
                              host.stdlib == FULGUR_STDLIB_LIBCXX ? "libc++" : "libstdc++"));
  if (plugin.cuda_version / 1000 != host.cuda_version / 1000)
    out.push_back(fmt::format("CUDA major: plugin {}, host {}", plugin.cuda_version / 1000, host.cuda_version / 1000));
  return out;
}

// The SDK rule: a plugin built against SDK N.x loads in a host N.y with y >= x. Empty when it does.
std::string sdk_version_problem(uint32_t plugin, uint32_t host) {
  const uint32_t plugin_major = FULGUR_SDK_VERSION_MAJOR_OF(plugin), plugin_minor = FULGUR_SDK_VERSION_MINOR_OF(plugin);
  const uint32_t host_major = FULGUR_SDK_VERSION_MAJOR_OF(host), host_minor = FULGUR_SDK_VERSION_MINOR_OF(host);
  if (plugin_major == 0)
    return fmt::format(
        "was built against a Fulgur SDK from before 1.0 (C++ interface {}), which this host (SDK {}.{}) does "
        "not load; rebuild the plugin against Fulgur {}.x: find_package(Fulgur {}.{}) and fulgur_add_plugin() "
        "in its CMakeLists.txt (see the README's 'Writing a plugin')",
        plugin_minor, host_major, host_minor, host_major, host_major, host_minor);
  if (plugin_major != host_major)
    return fmt::format(
        "was built against Fulgur SDK {}.{}, this host implements SDK {}.{}; a new SDK major is not compatible: "
        "rebuild the plugin against Fulgur {}.x (find_package(Fulgur {}.{}))",
        plugin_major, plugin_minor, host_major, host_minor, host_major, host_major, host_minor);
  if (plugin_minor > host_minor)
    return fmt::format(
        "was built against Fulgur SDK {}.{}, newer than this host's SDK {}.{}; upgrade Fulgur to {}.{} or later, "
        "or rebuild the plugin against SDK {}.{}",
        plugin_major, plugin_minor, host_major, host_minor, plugin_major, plugin_minor, host_major, host_minor);
  return {};
}

// The metadata-phase checks; empty when the plugin may be used.
std::string metadata_problem(const PluginMetadata& meta) {
  const fulgur_abi_tag& host = host_abi_tag();
  if (meta.abi_major != FULGUR_PLUGIN_ABI_MAJOR)
    return fmt::format(
        "built for plugin ABI {}.x, this host implements ABI {}.{} (Fulgur SDK {}.{}); rebuild the plugin against "
        "this Fulgur's SDK (find_package(Fulgur {}.{}) and fulgur_add_plugin())",
        meta.abi_major, FULGUR_PLUGIN_ABI_MAJOR, FULGUR_PLUGIN_ABI_MINOR, FULGUR_SDK_VERSION_MAJOR_OF(host.sdk_version),
        FULGUR_SDK_VERSION_MINOR_OF(host.sdk_version), FULGUR_SDK_VERSION_MAJOR_OF(host.sdk_version),
        FULGUR_SDK_VERSION_MINOR_OF(host.sdk_version));
  if (meta.abi_minor > FULGUR_PLUGIN_ABI_MINOR)
    return fmt::format(
        "needs plugin ABI {}.{}, this host implements {}.{}; upgrade Fulgur or rebuild the plugin "
        "against this SDK",
        meta.abi_major, meta.abi_minor, FULGUR_PLUGIN_ABI_MAJOR, FULGUR_PLUGIN_ABI_MINOR);
  if (!is_valid_plugin_kind(static_cast<uint32_t>(meta.kind)))
    return fmt::format("declares unknown kind {}", static_cast<uint32_t>(meta.kind));
  if (!valid_plugin_name(meta.name))
    return fmt::format("declares invalid name '{}' (use 1-63 of a-z 0-9 _ - .)", meta.name);
  if (std::string sdk = sdk_version_problem(meta.abi_tag.sdk_version, host.sdk_version); !sdk.empty()) return sdk;
  if (auto diffs = abi_tag_differences(meta.abi_tag, host); !diffs.empty()) {
    // The libtorch comes with the SDK: a plugin is rebuilt against this Fulgur's SDK (its CMake
    // package brings the libtorch this host uses), not against some libtorch on its own.
    const uint32_t sdk = meta.abi_tag.sdk_version;
    return fmt::format(
        "ABI tag differs from the host ({}): it was built against Fulgur SDK {}.{} with libtorch {}.{}, and this "
        "host is Fulgur SDK {}.{} with libtorch {}.{}; rebuild the plugin against this Fulgur's SDK "
        "(find_package(Fulgur {}.{}) and fulgur_add_plugin() in its CMakeLists.txt, which bring the libtorch "
        "this host uses)",
        fmt::join(diffs, "; "), FULGUR_SDK_VERSION_MAJOR_OF(sdk), FULGUR_SDK_VERSION_MINOR_OF(sdk),
        meta.abi_tag.torch_major, meta.abi_tag.torch_minor, FULGUR_SDK_VERSION_MAJOR_OF(host.sdk_version),
        FULGUR_SDK_VERSION_MINOR_OF(host.sdk_version), host.torch_major, host.torch_minor,
        FULGUR_SDK_VERSION_MAJOR_OF(host.sdk_version), FULGUR_SDK_VERSION_MINOR_OF(host.sdk_version));
  }
  return {};
}

std::string describe(PluginKind kind, std::string_view name) { return fmt::format("{} '{}'", to_string(kind), name); }

// Loaded libraries, never unloaded (CUDA, thread_locals and GNU_UNIQUE symbols make unloading
// unsafe) and never destroyed, so no static-destruction order can pull one out from under an
// object that is still alive at exit.
struct LoadedLibrary {
  std::shared_ptr<boost::dll::shared_library> library;
  const fulgur_plugin_list* list = nullptr;
};

std::mutex& library_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::map<std::string, LoadedLibrary>& loaded_libraries() {
  static auto* libraries = new std::map<std::string, LoadedLibrary>;
  return *libraries;
}

std::string cstr_or(const char* s, const char* fallback) { return s ? std::string(s) : std::string(fallback); }

// Compares the descriptor the code returns with the note the file carries.
std::string descriptor_mismatch(const fulgur_plugin_desc& desc, const PluginMetadata& note) {
  if (desc.struct_size < FULGUR_STRUCT_SIZE(fulgur_plugin_desc, destroy))
    return fmt::format("descriptor is {} bytes, ABI {}.0 needs at least {}", desc.struct_size, FULGUR_PLUGIN_ABI_MAJOR,
                       FULGUR_STRUCT_SIZE(fulgur_plugin_desc, destroy));
  if (!desc.create || !desc.destroy) return "descriptor has no create/destroy function";
  if (desc.abi_major != note.abi_major || desc.abi_minor != note.abi_minor)
    return fmt::format("ABI {}.{} in code, {}.{} in note", desc.abi_major, desc.abi_minor, note.abi_major,
                       note.abi_minor);
  if (cstr_or(desc.version, "") != note.version)
    return fmt::format("version '{}' in code, '{}' in note", cstr_or(desc.version, ""), note.version);
  if (!abi_tag_differences(desc.abi_tag, note.abi_tag).empty() || desc.abi_tag.sdk_version != note.abi_tag.sdk_version)
    return "ABI tag in code differs from the note";
  if (desc.option_count != note.options.size())
    return fmt::format("{} options in code, {} in note", desc.option_count, note.options.size());
  for (uint32_t i = 0; i < desc.option_count; ++i) {
    const fulgur_option_desc& o = desc.options[i];
    const OptionSchema& n = note.options[i];
    if (cstr_or(o.key, "") != n.key || o.type != static_cast<uint32_t>(n.type) ||
        cstr_or(o.default_value, "") != n.default_text)
      return fmt::format("option #{} ('{}') differs between code and note", i, cstr_or(o.key, ""));
  }
  return {};
}

}  // namespace

Options default_options(const PluginMetadata& metadata) {
  Options options(describe(metadata.kind, metadata.name));
  for (const auto& o : metadata.options) {
    if (!o.default_value)
      throw Error(ErrorKind::config,
                  fmt::format("{} needs option '{}' ({}), which has no default; select the plugin in the config and "
                              "set it in its table",
                              describe(metadata.kind, metadata.name), o.key, to_string(o.type)));
    options.set(o.key, *o.default_value);
  }
  return options;
}

PluginRegistry::PluginRegistry(std::vector<SearchDirectory> search_path, RegistryOptions options)
    : search_path_(std::move(search_path)), options_(options) {
  scan();
}

PluginRegistry::~PluginRegistry() = default;

void PluginRegistry::scan() {
  candidates_.clear();
  problems_.clear();
  std::set<fs::path> seen_directories;
  for (size_t index = 0; index < search_path_.size(); ++index) {
    const SearchDirectory& dir = search_path_[index];
    std::error_code ec;
    fs::path canonical = fs::weakly_canonical(dir.path, ec);
    if (ec) canonical = dir.path;
    if (!seen_directories.insert(canonical).second) continue;  // listed twice: first position counts
    if (!fs::is_directory(dir.path, ec)) {
      if (dir.origin == "config" || dir.origin == "FULGUR_PLUGIN_PATH")
        problems_.push_back({dir.path, true, ErrorKind::plugin_rejected,
                             fmt::format("plugin directory from {} does not exist", dir.origin)});
      continue;
    }
    const std::string dir_writable = writable_by_others(dir.path);
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(dir.path, ec))
      if (looks_like_shared_library(entry.path()) && fs::is_regular_file(entry.path())) files.push_back(entry.path());
    std::sort(files.begin(), files.end());  // deterministic order within a directory

    for (const fs::path& file : files) {
      NoteReadResult notes = read_plugin_notes(file);
      using S = NoteReadResult::Status;
      switch (notes.status) {
        case S::not_elf:
        case S::not_plugin:
          problems_.push_back({file, false, ErrorKind::plugin_rejected,
                               notes.detail.empty() ? "no Fulgur metadata note: not a plugin" : notes.detail});
          spdlog::debug("plugin scan: {} is not a Fulgur plugin", file.string());
          continue;
        case S::wrong_arch:
          problems_.push_back(
              {file, true, ErrorKind::plugin_rejected,
               fmt::format("wrong architecture: {}; rebuild the plugin for this machine", notes.detail)});
          continue;
        case S::corrupt:
          problems_.push_back({file, true, ErrorKind::plugin_rejected,
                               fmt::format("{}; rebuild or reinstall the plugin", notes.detail)});
          continue;
        case S::plugin:
          break;
      }
      std::string file_writable = writable_by_others(file);
      for (PluginMetadata& meta : notes.plugins) {
        PluginCandidate candidate;
        candidate.file = file;
        candidate.directory_index = index;
        candidate.metadata = std::move(meta);
        std::string problem = metadata_problem(candidate.metadata);
        if (problem.empty() && !options_.allow_writable && (!file_writable.empty() || !dir_writable.empty())) {
          problem = fmt::format(
              "refused because the {} is {} (anyone who can write it can run code in this "
              "process); fix with chmod go-w, or set [plugins] allow_writable = true",
              file_writable.empty() ? "directory " + dir.path.string() : "file",
              file_writable.empty() ? dir_writable : file_writable);
        }
        if (problem.empty() && dir.origin != "install" &&
            is_reserved_builtin_name(candidate.metadata.kind, candidate.metadata.name)) {
          problem = fmt::format("name '{}' is reserved for Fulgur's built-in {}; give the plugin another name",
                                candidate.metadata.name, to_string(candidate.metadata.kind));
        }
        if (!problem.empty()) {
          candidate.status = CandidateStatus::rejected;
          candidate.reason = std::move(problem);
        }
        candidates_.push_back(std::move(candidate));
      }
    }
  }

  // Duplicates: the first directory in search order that offers (kind, name) wins; two offers in
  // that same directory are ambiguous (an error only when selected); later ones are shadowed.
  std::map<std::pair<PluginKind, std::string>, std::vector<PluginCandidate*>> groups;
  for (auto& c : candidates_)
    if (c.status != CandidateStatus::rejected) groups[{c.metadata.kind, c.metadata.name}].push_back(&c);
  for (auto& [key, group] : groups) {
    const size_t winner_dir = group.front()->directory_index;  // candidates are in search order
    std::vector<PluginCandidate*> winners;
    for (PluginCandidate* c : group)
      if (c->directory_index == winner_dir) winners.push_back(c);
    if (winners.size() > 1) {
      for (PluginCandidate* c : winners) {
        std::vector<std::string> others;
        for (PluginCandidate* o : winners)
          if (o != c) others.push_back(o->file.string());
        c->status = CandidateStatus::ambiguous;
        c->reason = fmt::format("also provided by {} in the same directory", fmt::join(others, ", "));
      }
    }
    for (PluginCandidate* c : group)
      if (c->directory_index != winner_dir) {
        c->status = CandidateStatus::shadowed;
        c->reason = fmt::format("shadowed by {} (earlier in the search path)", winners.front()->file.string());
      }
  }

  if (options_.use_verdict_cache) apply_recorded_verdicts();
}

// A plugin that `fulgur plugins check` saw crash, abort or hang in a child process would take this
// process down the same way: refuse it with the recorded reason. Shadowed candidates keep their
// status, so the winner of a (kind, name) never changes because of a verdict.
void PluginRegistry::apply_recorded_verdicts() {
  const fs::path cache = verdict_cache_path();
  std::error_code ec;
  if (cache.empty() || !fs::exists(cache, ec)) return;
  const std::vector<VerdictRecord> records = load_verdicts(cache);
  if (records.empty()) return;
  for (PluginCandidate& c : candidates_) {
    if (c.status != CandidateStatus::available && c.status != CandidateStatus::ambiguous) continue;
    std::optional<VerdictRecord> subject = verdict_subject(c.file, c.metadata);
    if (!subject) continue;
    const VerdictRecord* record = find_verdict(records, *subject);
    if (!record || !verdict_refuses(record->verdict)) continue;
    c.status = CandidateStatus::rejected;
    c.error_kind = ErrorKind::plugin_rejected;
    c.reason = fmt::format(
        "refused: `fulgur plugins check` recorded that it {}; fix or replace the file, or recheck with `fulgur "
        "plugins check {} --kind {} --force`",
        record->reason, c.metadata.name, to_string(c.metadata.kind));
  }
}

const PluginCandidate& PluginRegistry::resolve(PluginKind kind, std::string_view name) const {
  const PluginCandidate* chosen = nullptr;
  std::vector<const PluginCandidate*> ambiguous, rejected;
  for (const auto& c : candidates_) {
    if (c.metadata.kind != kind || c.metadata.name != name) continue;
    if (c.status == CandidateStatus::available && !chosen) chosen = &c;
    if (c.status == CandidateStatus::ambiguous) ambiguous.push_back(&c);
    if (c.status == CandidateStatus::rejected) rejected.push_back(&c);
  }
  if (chosen) return *chosen;
  if (!ambiguous.empty()) {
    std::vector<std::string> files;
    for (const auto* c : ambiguous) files.push_back(c->file.string());
    throw Error(ErrorKind::plugin_ambiguous,
                fmt::format("{} is provided by more than one library in the same directory: {}; remove all but one",
                            describe(kind, name), fmt::join(files, ", ")));
  }
  if (!rejected.empty()) {
    std::vector<std::string> reasons;
    for (const auto* c : rejected) reasons.push_back(fmt::format("plugin {}: {}", c->file.string(), c->reason));
    throw Error(ErrorKind::plugin_rejected,
                fmt::format("{} was found but refused:\n  {}", describe(kind, name), fmt::join(reasons, "\n  ")));
  }
  std::vector<std::string> available;
  for (const auto& c : candidates_)
    if (c.metadata.kind == kind && c.status == CandidateStatus::available) available.push_back(c.metadata.name);
  std::string message = fmt::format("no {} plugin named '{}'", to_string(kind), name);
  if (std::string suggestion = closest_match(name, available); !suggestion.empty())
    message += fmt::format("; did you mean '{}'?", suggestion);
  if (!message.ends_with('?')) message += '.';  // two sentences, not one run together
  message += available.empty() ? fmt::format(" No {} plugins are available.", to_string(kind))
                               : fmt::format(" Available {} plugins: {}.", to_string(kind), fmt::join(available, ", "));
  std::vector<std::string> broken;
  for (const auto& p : problems_)
    if (p.is_plugin_error) broken.push_back(fmt::format("{}: {}", p.file.string(), p.reason));
  for (const auto& c : candidates_)
    if (c.status == CandidateStatus::rejected && c.metadata.kind == kind)
      broken.push_back(fmt::format("{} '{}' in {}: {}", to_string(kind), c.metadata.name, c.file.string(), c.reason));
  if (!broken.empty()) message += fmt::format("\nRefused plugin files:\n  {}", fmt::join(broken, "\n  "));
  std::vector<std::string> dirs;
  for (const auto& d : search_path_) dirs.push_back(fmt::format("{} ({})", d.path.string(), d.origin));
  message +=
      fmt::format("\nSearched: {}. Add a directory with [plugins] paths or FULGUR_PLUGIN_PATH.", fmt::join(dirs, ", "));
  throw Error(ErrorKind::plugin_not_found, message);
}

namespace {

// Loads (once per process) the library of `candidate` and returns its descriptor list.
const LoadedLibrary& load_library(const PluginCandidate& candidate) {
  std::lock_guard lock(library_mutex());
  std::error_code ec;
  const std::string key = fs::weakly_canonical(candidate.file, ec).string();
  auto& libraries = loaded_libraries();
  if (auto it = libraries.find(key); it != libraries.end()) return it->second;

  LoadedLibrary loaded;
  // Its static initializers run now: a crash in them names the file.
  install_crash_reporter();
  const std::string loading = fmt::format("{} ({}), while loading its library",
                                          describe(candidate.metadata.kind, candidate.metadata.name), key);
  const CrashScope crash_scope(loading.c_str());
  try {
    // rtld_now: an unresolved symbol fails here with its name, not later with a dead process.
    // rtld_local: two plugins' private helpers never bind to each other.
    loaded.library = std::make_shared<boost::dll::shared_library>(
        boost::dll::fs::path(key), boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::string hint = "check that its dependencies are installed and that it was built against this Fulgur";
    if (what.find("fulgur_abi_v") != std::string::npos)
      hint = fmt::format("it was built for another ABI than this host's ({}); rebuild it against this Fulgur SDK",
                         host_abi_guard_symbol());
    else if (what.find("undefined symbol") != std::string::npos)
      hint =
          "it references a symbol no loaded library provides; rebuild it with fulgur_add_plugin() "
          "(links with --no-undefined) against this Fulgur and libtorch";
    throw Error(ErrorKind::plugin_load,
                fmt::format("plugin {}: cannot be loaded: {}; {}", candidate.file.string(), what, hint));
  }
  if (!loaded.library->has(FULGUR_PLUGIN_QUERY_SYMBOL))
    throw Error(ErrorKind::plugin_load,
                fmt::format("plugin {}: entry point {} not found; it is not a Fulgur plugin library or was built for "
                            "another plugin ABI major version",
                            candidate.file.string(), FULGUR_PLUGIN_QUERY_SYMBOL));
  auto query = loaded.library->get<const fulgur_plugin_list*()>(FULGUR_PLUGIN_QUERY_SYMBOL);
  loaded.list = query();
  if (!loaded.list || loaded.list->struct_size < FULGUR_STRUCT_SIZE(fulgur_plugin_list, items) ||
      loaded.list->count > 4096 || (loaded.list->count && !loaded.list->items))
    throw Error(ErrorKind::plugin_load, fmt::format("plugin {}: {} returned an invalid descriptor list",
                                                    candidate.file.string(), FULGUR_PLUGIN_QUERY_SYMBOL));
  return libraries.emplace(key, std::move(loaded)).first->second;
}

const fulgur_plugin_desc& find_descriptor(const LoadedLibrary& library, const PluginCandidate& candidate) {
  const fulgur_plugin_desc* found = nullptr;
  for (uint32_t i = 0; i < library.list->count; ++i) {
    const fulgur_plugin_desc* desc = library.list->items[i];
    if (desc && desc->kind == static_cast<uint32_t>(candidate.metadata.kind) && desc->name &&
        candidate.metadata.name == desc->name) {
      found = desc;
      break;
    }
  }
  if (!found)
    throw Error(ErrorKind::plugin_load,
                fmt::format("plugin {}: metadata mismatch: the note declares {} but the code does not provide it; the "
                            "file is corrupt or was edited after linking, rebuild it",
                            candidate.file.string(), describe(candidate.metadata.kind, candidate.metadata.name)));
  if (std::string mismatch = descriptor_mismatch(*found, candidate.metadata); !mismatch.empty())
    throw Error(
        ErrorKind::plugin_load,
        fmt::format("plugin {}: metadata mismatch for {}: {}; the file is corrupt or was edited after linking, "
                    "rebuild it",
                    candidate.file.string(), describe(candidate.metadata.kind, candidate.metadata.name), mismatch));
  return *found;
}

}  // namespace

void PluginRegistry::load(const PluginCandidate& candidate) const {
  find_descriptor(load_library(candidate), candidate);
}

PluginObject PluginRegistry::create(PluginKind kind, std::string_view name, const Options& options) const {
  return create(resolve(kind, name), options);
}

PluginObject PluginRegistry::create(const PluginCandidate& candidate, const Options& options) const {
  const PluginKind kind = candidate.metadata.kind;
  const std::string& name = candidate.metadata.name;
  const LoadedLibrary& library = load_library(candidate);
  const fulgur_plugin_desc& desc = find_descriptor(library, candidate);

  std::array<char, 4096> error{};
  fulgur_create_args args{static_cast<uint32_t>(sizeof(fulgur_create_args)), &options, error.data(), error.size()};
  void* object = nullptr;
  install_crash_reporter();
  const std::string creating = fmt::format("{} ({}), while creating it", describe(kind, name), candidate.file.string());
  try {
    const CrashScope crash_scope(creating.c_str());
    object = desc.create(&args);  // the contract says it never throws; enforce it anyway
  } catch (const std::exception& e) {
    std::snprintf(error.data(), error.size(), "%s", e.what());
  } catch (...) {
    std::snprintf(error.data(), error.size(), "unknown exception escaped the factory");
  }
  if (!object)
    throw Error(ErrorKind::plugin_create,
                fmt::format("{} from {} failed to initialise: {}", describe(kind, name), candidate.file.string(),
                            error[0] ? error.data() : "the factory returned no object and no message"));
  // The deleter pins the library: the object is destroyed by plugin code, while it is loaded.
  auto pin = library.library;
  auto destroy = desc.destroy;
  return PluginObject(object, [pin, destroy](void* p) { destroy(p); });
}

}  // namespace fulgur
