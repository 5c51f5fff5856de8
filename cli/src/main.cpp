// The `fulgur` command: inspects plugins from their metadata alone (no plugin code runs), except
// `plugins load`, which exists to run a plugin's loading and construction on purpose.
//
//   fulgur plugins list [--config FILE] [--all]
//   fulgur plugins describe NAME | --all [--kind KIND] [--config FILE] [--json]
//                                  (--json: the same data as JSON, what scripts/docs.sh turns into
//                                  the plugin reference pages)
//   fulgur plugins load NAME [--kind KIND] [--config FILE]   (loads, creates, destroys it)
//   fulgur plugins check [NAME | --all] [--kind KIND] [--config FILE] [--timeout S] [--force]
//                                  (the same in child processes: crashes and hangs are reported)
//   fulgur config check FILE       (parses the TOML and checks every plugin table)
//   fulgur weights convert IN OUT  (between .pt / .ckpt and .safetensors)
//   fulgur weights inspect FILE    (names, dtypes, shapes)
//   fulgur checkpoint consolidate DIR OUT | inspect DIR   (distributed checkpoint directories)
//                                  (weights, checkpoint: --config FILE for its [storage] table)
//   fulgur fit | validate | test | predict --config FILE ...   (fulgur/cli.h: runs training with the
//                                  model and datamodule plugins that [model] / [data] name)
#include <fulgur/cli.h>
#include <fulgur/config.h>
#include <fulgur/error.h>
#include <fulgur/host.h>
#include <fulgur/registry/registry.h>
#include <fulgur/suggest.h>

#include "checkpoint_command.h"
#include "plugin_check.h"
#include "storage_paths.h"
#include "weights_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace fulgur;

constexpr const char* kUsage =
    "usage:\n"
    "  fulgur fit|validate|test|predict --config FILE [--config FILE ...] [--SECTION.KEY=VALUE ...]\n"
    "                                   [--ckpt_path=PATH|last|best] [--print-config] [--help]\n"
    "  fulgur quantize --config FILE --ckpt_path=FILE [--method=int8|int4] [--group_size=N] [--layers=REGEX]\n"
    "                  [--out=FILE]\n"
    "  fulgur plugins list [--config FILE] [--all]\n"
    "  fulgur plugins describe NAME | --all [--kind KIND] [--config FILE] [--json]\n"
    "  fulgur plugins load NAME [--kind KIND] [--config FILE]\n"
    "  fulgur plugins check [NAME | --all] [--kind KIND] [--config FILE] [--timeout SECONDS] [--force]\n"
    "  fulgur config check FILE\n"
    "  fulgur weights convert IN OUT [--config FILE]\n"
    "  fulgur weights inspect FILE [--config FILE]\n"
    "  fulgur checkpoint consolidate DIR OUT [--config FILE]\n"
    "  fulgur checkpoint inspect DIR [--config FILE]\n"
    "  (weights and checkpoint: paths may be URLs such as s3://; --config FILE takes the storage plugins\n"
    "  and the [storage] table from the TOML of the run that wrote them)\n";

struct Args {
  std::vector<std::string> positional;
  std::optional<std::string> config;
  std::optional<std::string> kind;
  bool all = false;
  bool force = false;
  bool json = false;
  std::optional<double> timeout;
};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) {
      if (i + 1 >= argc) throw Error(ErrorKind::invalid_argument, fmt::format("{} needs a value\n{}", flag, kUsage));
      return std::string(argv[++i]);
    };
    if (a == "--config")
      args.config = value("--config");
    else if (a == "--kind")
      args.kind = value("--kind");
    else if (a == "--all")
      args.all = true;
    else if (a == "--force")
      args.force = true;
    else if (a == "--json")
      args.json = true;
    else if (a == "--timeout") {
      const std::string text = value("--timeout");
      char* end = nullptr;
      const double seconds = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !(seconds > 0))
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("--timeout needs a positive number of seconds, got '{}'", text));
      args.timeout = seconds;
    } else if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a.starts_with("--"))
      throw Error(ErrorKind::invalid_argument, fmt::format("unknown flag {}\n{}", a, kUsage));
    else
      args.positional.push_back(a);
  }
  return args;
}

std::unique_ptr<PluginRegistry> make_registry(const std::optional<Config>& config, bool use_verdicts = true) {
  SearchPathOptions sp;
  RegistryOptions ro;
  ro.use_verdict_cache = use_verdicts;
  if (config) {
    sp.config_paths = config->plugin_paths;
    ro.allow_writable = config->allow_writable_plugins;
  }
  return std::make_unique<PluginRegistry>(plugin_search_path(sp), ro);
}

// "1.0"; a plugin built before SDK 1.0 recorded its C++ interface major: "pre-1.0 (7)".
std::string sdk_version_text(uint32_t v) {
  if (FULGUR_SDK_VERSION_MAJOR_OF(v) == 0) return fmt::format("pre-1.0 ({})", FULGUR_SDK_VERSION_MINOR_OF(v));
  return fmt::format("{}.{}", FULGUR_SDK_VERSION_MAJOR_OF(v), FULGUR_SDK_VERSION_MINOR_OF(v));
}

int list_plugins(const Args& args) {
  std::optional<Config> config;
  if (args.config) config = load_config(*args.config);
  auto registry = make_registry(config);
  const auto& tag = host_abi_tag();
  std::cout << fmt::format("Host: plugin ABI {}.{}, SDK {}, libtorch {}.{}, CUDA {}\n", FULGUR_PLUGIN_ABI_MAJOR,
                           FULGUR_PLUGIN_ABI_MINOR, sdk_version_text(tag.sdk_version), tag.torch_major, tag.torch_minor,
                           tag.cuda_version);
  std::cout << "Search path:\n";
  for (const auto& d : registry->search_path()) std::cout << fmt::format("  {:<20} {}\n", d.origin, d.path.string());
  std::cout << fmt::format("\n{:<12} {:<20} {:<9} {:<9} {:<10} {}\n", "KIND", "NAME", "VERSION", "SDK", "STATUS",
                           "FILE");
  for (const auto& c : registry->candidates()) {
    std::cout << fmt::format("{:<12} {:<20} {:<9} {:<9} {:<10} {}\n", to_string(c.metadata.kind), c.metadata.name,
                             c.metadata.version, sdk_version_text(c.metadata.abi_tag.sdk_version), to_string(c.status),
                             c.file.string());
    if (!c.reason.empty()) std::cout << fmt::format("{:<12} -> {}\n", "", c.reason);
  }
  bool header = false;
  for (const auto& p : registry->problems()) {
    if (!p.is_plugin_error && !args.all) continue;
    if (!header) std::cout << "\nFiles that are not usable plugins:\n";
    header = true;
    std::cout << fmt::format("  {}: {}\n", p.file.string(), p.reason);
  }
  return 0;
}

std::optional<PluginKind> kind_arg(const Args& args) {
  if (!args.kind) return std::nullopt;
  std::optional<PluginKind> kind = parse_plugin_kind(*args.kind);
  if (!kind)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("unknown kind '{}'; use accelerator, strategy, precision, logger, profiler, callback, "
                            "model or datamodule",
                            *args.kind));
  return kind;
}

// One plugin's metadata as JSON: what the text form of `describe` prints, field for field.
nlohmann::ordered_json describe_json(const PluginCandidate& c) {
  const auto& m = c.metadata;
  nlohmann::ordered_json options = nlohmann::ordered_json::array();
  for (const auto& o : m.options)
    options.push_back({{"key", o.key},
                       {"type", to_string(o.type)},
                       {"required", !o.default_value},
                       {"default", o.default_value ? o.default_text : ""},
                       {"help", o.help}});
  return {{"kind", to_string(m.kind)},
          {"name", m.name},
          {"version", m.version},
          {"description", m.description},
          {"file", c.file.string()},
          {"status", to_string(c.status)},
          {"reason", c.reason},
          {"sdk", sdk_version_text(m.abi_tag.sdk_version)},
          {"abi", fmt::format("{}.{}", m.abi_major, m.abi_minor)},
          {"libtorch", fmt::format("{}.{}", m.abi_tag.torch_major, m.abi_tag.torch_minor)},
          {"options", std::move(options)}};
}

int describe_plugin(const Args& args) {
  // NAME, or --all for every plugin found (the docs' reference pages are made from --all --json).
  if (args.positional.size() != (args.all ? 2u : 3u)) throw Error(ErrorKind::invalid_argument, kUsage);
  std::optional<Config> config;
  if (args.config) config = load_config(*args.config);
  auto registry = make_registry(config);
  std::optional<PluginKind> kind = kind_arg(args);
  std::vector<const PluginCandidate*> matches;
  for (const auto& c : registry->candidates())
    if ((args.all || c.metadata.name == args.positional[2]) && (!kind || c.metadata.kind == *kind))
      matches.push_back(&c);
  if (matches.empty() && !args.all) {
    // Let resolve() produce the "did you mean" message for the most likely kind.
    registry->resolve(kind.value_or(PluginKind::callback), args.positional[2]);
  }
  if (args.json) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const PluginCandidate* c : matches) out.push_back(describe_json(*c));
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  for (const PluginCandidate* c : matches) {
    const auto& m = c->metadata;
    std::cout << fmt::format(
        "{} '{}' {}\n  {}\n  file:   {}\n  status: {}{}\n  SDK:    {} (this host: {})\n  ABI:    {}.{}, libtorch "
        "{}.{}\n",
        to_string(m.kind), m.name, m.version, m.description, c->file.string(), to_string(c->status),
        c->reason.empty() ? "" : " (" + c->reason + ")", sdk_version_text(m.abi_tag.sdk_version),
        sdk_version_text(host_abi_tag().sdk_version), m.abi_major, m.abi_minor, m.abi_tag.torch_major,
        m.abi_tag.torch_minor);
    if (m.options.empty()) {
      std::cout << "  options: none\n";
      continue;
    }
    std::cout << fmt::format("  {:<24} {:<17} {:<14} {}\n", "OPTION", "TYPE", "DEFAULT", "HELP");
    for (const auto& o : m.options)
      std::cout << fmt::format("  {:<24} {:<17} {:<14} {}\n", o.key, to_string(o.type),
                               o.default_value ? o.default_text : "(required)", o.help);
  }
  return 0;
}

// Runs the load and create phases that `list` and `describe` never run: dlopen with every symbol
// resolved, the descriptor cross-checked against the note, and the plugin's constructor. With
// --config, the whole config is validated and the plugin gets the options of the table selecting
// it; otherwise its schema defaults.
int load_plugin(const Args& args) {
  if (args.positional.size() != 3) throw Error(ErrorKind::invalid_argument, kUsage);
  const std::string& name = args.positional[2];
  std::optional<Config> config;
  if (args.config) config = load_config(*args.config);
  auto registry = make_registry(config);
  std::optional<PluginKind> kind = kind_arg(args);
  if (!kind) {
    for (const auto& c : registry->candidates())
      if (c.metadata.name == name) {
        if (kind && *kind != c.metadata.kind)
          throw Error(ErrorKind::invalid_argument,
                      fmt::format("'{}' names plugins of more than one kind; pick one with --kind", name));
        kind = c.metadata.kind;
      }
  }
  const PluginCandidate& candidate = registry->resolve(kind.value_or(PluginKind::callback), name);
  const PluginSelection* selected = nullptr;
  if (config) {
    validate_plugins(*config, *registry);
    for (const PluginSelection* sel : config->selections())
      if (sel->kind == candidate.metadata.kind && sel->name == name) selected = sel;
  }
  const Options options = selected ? selected->options : default_options(candidate.metadata);
  PluginObject object = registry->create(candidate.metadata.kind, name, options);
  std::vector<std::string> opts;
  for (const auto& [k, v] : options.values()) opts.push_back(fmt::format("{} = {}", k, format_option_value(v)));
  std::cout << fmt::format("created {} '{}' from {}{}\n", to_string(candidate.metadata.kind), name,
                           candidate.file.string(), opts.empty() ? "" : fmt::format(" ({})", fmt::join(opts, ", ")));
  object.reset();
  std::cout << "destroyed\n";
  return 0;
}

// Loads and creates plugins in child processes (see plugin_check.cpp); the verdicts it records
// make later runs refuse a plugin that crashed, aborted or hung.
int check_plugins(const Args& args) {
  const size_t n = args.positional.size();
  if (n > 3 || (n == 3) == args.all || (n == 2 && !args.all))
    throw Error(ErrorKind::invalid_argument, fmt::format("plugins check needs one NAME or --all\n{}", kUsage));
  std::optional<Config> config;
  if (args.config) config = load_config(*args.config);
  auto registry = make_registry(config, /*use_verdicts=*/false);  // a recheck must see recorded ones too
  cli::CheckRequest request;
  if (n == 3) request.name = args.positional[2];
  request.kind = kind_arg(args);
  request.force = args.force;
  if (args.timeout) request.timeout_s = *args.timeout;
  return cli::check_plugins(*registry, request);
}

int check_config(const Args& args) {
  if (args.positional.size() != 3) throw Error(ErrorKind::invalid_argument, kUsage);
  Config config = load_config(args.positional[2]);
  auto registry = make_registry(config);
  check_config_values(config, *registry);  // structure, schemas and every value, without training
  for (PluginSelection* sel : config.selections()) {
    std::vector<std::string> opts;
    for (const auto& [k, v] : sel->options.values()) opts.push_back(fmt::format("{} = {}", k, format_option_value(v)));
    std::cout << fmt::format("{:<12} {:<20} {}\n", to_string(sel->kind), sel->name, fmt::join(opts, ", "));
  }
  std::cout << "config OK\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], cli::kCheckChildCommand) == 0) return cli::check_child_main(argc, argv);
  if (argc >= 2 && is_run_subcommand(argv[1])) {
    if (const char* level = std::getenv("FULGUR_LOG_LEVEL")) spdlog::set_level(spdlog::level::from_str(level));
    CliApp app;  // no factories: [model] / [data] name plugins
    return run_cli(argc, argv, app);
  }
  if (const char* level = std::getenv("FULGUR_LOG_LEVEL")) spdlog::set_level(spdlog::level::from_str(level));
  try {
    Args args = parse_args(argc, argv);
    const auto& p = args.positional;
    if (p.size() >= 2 && p[0] == "plugins" && p[1] == "list") return list_plugins(args);
    if (p.size() >= 2 && p[0] == "plugins" && p[1] == "describe") return describe_plugin(args);
    if (p.size() >= 2 && p[0] == "plugins" && p[1] == "load") return load_plugin(args);
    if (p.size() >= 2 && p[0] == "plugins" && p[1] == "check") return check_plugins(args);
    if (p.size() >= 2 && p[0] == "config" && p[1] == "check") return check_config(args);
    if (!p.empty() && (p[0] == "weights" || p[0] == "checkpoint")) {
      if (args.kind || args.all || args.force || args.json || args.timeout)
        throw Error(ErrorKind::invalid_argument, fmt::format("fulgur {} takes no flag but --config\n{}", p[0], kUsage));
      // --config: the storage plugins and [storage] options of the run that wrote the files.
      if (args.config) {
        const std::optional<Config> config = load_config(*args.config);
        cli::configure_storage(*config, *make_registry(config));
      } else {
        cli::configure_storage();
      }
      return p[0] == "weights" ? cli::weights_main(p) : cli::checkpoint_main(p);
    }
    if (!p.empty()) {
      const std::vector<std::string> commands = {"fit",     "validate", "test",    "predict",   "quantize",
                                                 "plugins", "config",   "weights", "checkpoint"};
      std::string message = fmt::format("unknown command '{}'", p[0]);
      if (std::string s = closest_match(p[0], commands); !s.empty()) message += fmt::format("; did you mean '{}'?", s);
      std::cerr << "fulgur: error: " << message << "\n";
    }
    std::cerr << kUsage;
    return 2;
  } catch (const Error& e) {
    std::cerr << "fulgur: error: " << e.what() << "\n";
    return 1;
  }
}
