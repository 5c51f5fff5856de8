// `fulgur fit | validate | test | predict | quantize` (fulgur/cli.h): layered config, flags,
// --print-config, per-subcommand --help, checks that refuse bad input before anything starts, then
// one stage (or, for quantize, the model's weights quantized and written).
#include <fulgur/callback.h>
#include <fulgur/checkpoint_io.h>
#include <fulgur/cli.h>
#include <fulgur/config.h>
#include <fulgur/data_module.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/nn/linear.h>
#include <fulgur/registry/registry.h>
#include <fulgur/storage.h>
#include <fulgur/suggest.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>
#include <fulgur/weights.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace fulgur {

namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kSubcommands = {"fit", "validate", "test", "predict", "quantize"};

// Bad input: one line, exit 2, nothing started.
struct UsageError : Error {
  explicit UsageError(const std::string& message) : Error(ErrorKind::invalid_argument, message) {}
};

struct CliArgs {
  std::string subcommand;
  std::vector<fs::path> configs;
  std::vector<std::string> overrides;  // "section.key=value"
  std::vector<std::string> flags;      // as typed, for the header of the saved config
  std::optional<std::string> ckpt_path;
  // quantize: --method, --group_size, --layers, --out.
  std::string quantize_method = "int8";
  int64_t quantize_group_size = 128;
  std::string quantize_layers;
  std::string quantize_out;
  std::string quantize_activations;  // "" = what the checkpoint's layers learned
  bool print_config = false;
  bool help = false;
};

std::string usage(const std::string& program, const std::string& subcommand) {
  return fmt::format(
      "usage: {0} {1} --config FILE [--config FILE ...] [--SECTION.KEY=VALUE ...] [--ckpt_path=PATH|last|best]\n"
      "       [--print-config] [--help]\n"
      "  --config FILE          TOML config; several are merged in order (later files win)\n"
      "  --SECTION.KEY=VALUE    override one value: --trainer.max_epochs=3, --model.lr=3e-4, --data.batch_size=64,\n"
      "                         --model=NAME (selects the plugin), --callbacks.NAME.KEY=VALUE ([[callbacks]] entry)\n"
      "  --ckpt_path=PATH       checkpoint to {2}: a file, \"last\" or \"best\"\n"
      "  --print-config         print the merged config with every default and exit\n"
      "Precedence: defaults < config files in order < flags. The run writes its merged config to\n"
      "<log dir>/config.toml; `{0} {1} --config <that file>` reproduces it.\n{3}",
      program, subcommand.empty() ? "fit|validate|test|predict|quantize" : subcommand,
      subcommand == "fit" ? "resume from" : "load weights from",
      subcommand != "quantize"
          ? ""
          : "quantize: the model's fulgur::nn::Linear weights from --ckpt_path=FILE, stored for serving:\n"
            "  --method=int8|int4     int8: one scale per output channel; int4: a scale and zero per group (default "
            "int8)\n"
            "  --group_size=N         int4 inputs per group: 32, 64, 128 or 256 (default 128)\n"
            "  --layers=REGEX         only the layers whose dotted name matches (default: every fulgur::nn::Linear)\n"
            "  --out=FILE             the .safetensors file to write (default: <checkpoint>-<method>.safetensors)\n"
            "  --activations=none|per_token|per_tensor  serve the layers with int8 inputs, as the qat callback's\n"
            "                         `activations` trained them (default: per_tensor for layers that learned input\n"
            "                         scales, none otherwise)\n"
            "`fulgur predict --config ... --ckpt_path=FILE` then serves the quantized model.\n");
}

CliArgs parse_cli(int argc, char** argv, const std::string& program) {
  CliArgs args;
  if (argc < 2)
    throw UsageError("a subcommand is needed: fit, validate, test, predict or quantize\n" + usage(program, ""));
  args.subcommand = argv[1];
  if (!is_run_subcommand(args.subcommand)) {
    std::string message = fmt::format("unknown subcommand '{}'", args.subcommand);
    if (auto s = closest_match(args.subcommand, kSubcommands); !s.empty())
      message += fmt::format("; did you mean '{}'?", s);
    if (!message.ends_with('?')) message += '.';
    throw UsageError(message + fmt::format(" Subcommands: {}.", fmt::join(kSubcommands, ", ")));
  }
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next_value = [&](const std::string& flag) {
      if (i + 1 >= argc) throw UsageError(fmt::format("{} needs a value", flag));
      return std::string(argv[++i]);
    };
    if (a == "-h" || a == "--help") {
      args.help = true;
    } else if (a == "--print-config" || a == "--print_config") {
      args.print_config = true;
    } else if (a == "--config" || a.starts_with("--config=")) {
      args.configs.emplace_back(a == "--config" ? next_value(a) : a.substr(9));
    } else if (args.subcommand == "quantize" &&
               (a.starts_with("--method") || a.starts_with("--group_size") || a.starts_with("--layers") ||
                a.starts_with("--out") || a.starts_with("--activations"))) {
      const size_t eq = a.find('=');
      const std::string flag = a.substr(0, eq);
      const std::string value = eq == std::string::npos ? next_value(flag) : a.substr(eq + 1);
      if (flag == "--method") {
        args.quantize_method = value;
      } else if (flag == "--group_size") {
        try {
          args.quantize_group_size = std::stoll(value);
        } catch (const std::exception&) {
          throw UsageError(fmt::format("--group_size={}: expected a whole number (32, 64, 128 or 256)", value));
        }
      } else if (flag == "--layers") {
        args.quantize_layers = value;
      } else if (flag == "--out") {
        args.quantize_out = value;
      } else if (flag == "--activations") {
        if (value != "none" && value != "per_token" && value != "per_tensor")
          throw UsageError(fmt::format("--activations={}: expected \"none\", \"per_token\" or \"per_tensor\"", value));
        args.quantize_activations = value;
      } else {
        throw UsageError(fmt::format(
            "unknown flag '{}' for quantize: --method, --group_size, --layers, --out, --activations", flag));
      }
      args.flags.push_back(flag + "=" + value);
    } else if (a == "--ckpt_path" || a.starts_with("--ckpt_path=")) {
      args.ckpt_path = a == "--ckpt_path" ? next_value(a) : a.substr(12);
      args.flags.push_back("--ckpt_path=" + *args.ckpt_path);
    } else if (a.starts_with("--") && a.size() > 2) {
      std::string text = a.substr(2);
      // --trainer.max_epochs 3 as well as --trainer.max_epochs=3
      if (text.find('=') == std::string::npos) text += "=" + next_value(a);
      args.overrides.push_back(text);
      args.flags.push_back("--" + text);
    } else {
      throw UsageError(fmt::format("unexpected argument '{}'; flags start with --, config files follow --config", a));
    }
  }
  return args;
}

std::string describe_options(const std::string& title, const std::vector<OptionSchema>& schema) {
  std::string out = fmt::format("\n{}\n", title);
  if (schema.empty()) return out + "  (no options)\n";
  for (const OptionSchema& o : schema)
    out += fmt::format("  {:<34} {:<12} {:<16} {}\n", o.key, to_string(o.type),
                       o.default_value ? o.default_text : "(required)", o.help);
  return out;
}

std::unique_ptr<PluginRegistry> make_registry(const Config& config) {
  SearchPathOptions sp;
  sp.config_paths = config.plugin_paths;
  RegistryOptions ro;
  ro.allow_writable = config.allow_writable_plugins;
  return std::make_unique<PluginRegistry>(plugin_search_path(sp), ro);
}

// --help with a config: every selected plugin's options, the way `fulgur plugins describe` shows them.
std::string help_text(const CliApp& app, const CliArgs& args, Config* config, const PluginRegistry* registry) {
  std::string out = usage(app.program, args.subcommand);
  out += describe_options("[trainer] options (--trainer.KEY=VALUE):", trainer_option_schema());
  if (!config || !registry) {
    out += "\nWith --config, --help also lists the options of the plugins, model and data the config selects.\n";
    return out;
  }
  for (PluginSelection* sel : config->selections()) {
    const PluginCandidate& c = registry->resolve(sel->kind, sel->name);
    out += describe_options(fmt::format("{} '{}' {} ({}): {}", to_string(sel->kind), sel->name, c.metadata.version,
                                        c.file.string(), c.metadata.description),
                            c.metadata.options);
  }
  if (app.model_schema) out += describe_options("[model] options (--model.KEY=VALUE):", *app.model_schema);
  if (app.data_schema) out += describe_options("[data] options (--data.KEY=VALUE):", *app.data_schema);
  return out;
}

// The model and the datamodule: the program's own classes, or plugins named in [model] / [data].
struct UserObjects {
  std::shared_ptr<Module> model;
  std::shared_ptr<DataModule> data;
};

template <class T>
std::shared_ptr<T> adopt_plugin(PluginObject object) {
  // A shared_ptr made from the raw pointer (not an aliasing one): torch::nn::Module relies on
  // enable_shared_from_this (modules(), children()). The deleter keeps the plugin object, whose own
  // deleter calls the library's destroy.
  T* raw = static_cast<T*>(object.get());
  return std::shared_ptr<T>(raw, [keep = std::move(object)](T*) mutable { keep.reset(); });
}

UserObjects create_user_objects(const CliApp& app, Config& config, const PluginRegistry& registry) {
  UserObjects out;
  auto make_model = [&] {
    if (app.make_model) {
      out.model = app.make_model(config.model);
    } else {
      const PluginSelection& sel = config.model_plugin;
      out.model = adopt_plugin<Module>(registry.create(PluginKind::model, sel.name, sel.options));
    }
  };
  auto make_data = [&] {
    if (app.make_data) {
      out.data = app.make_data(config.data);
    } else {
      const PluginSelection& sel = config.data_plugin;
      out.data = adopt_plugin<DataModule>(registry.create(PluginKind::datamodule, sel.name, sel.options));
    }
  };
  // [links]: the datamodule first, so that the model is built with its values (LightningCLI's
  // apply_on="instantiate"). Without links the model comes first, as it always did: its initial
  // weights follow [trainer] seed whatever the datamodule's constructor draws.
  if (config.links.empty()) {
    make_model();
    make_data();
  } else {
    make_data();
    apply_links(config, *out.data);
    make_model();
  }
  // The typed, defaulted values are what the Trainer logs and checkpoints as hyperparameters.
  out.model->hparams = config.model;
  out.data->hparams = config.data;
  return out;
}

void require_user_tables(const CliApp& app, const Config& config) {
  auto missing = [&](const char* table, const char* kind) {
    return UsageError(fmt::format(
        "{}: no {} selected: add [{}] name = \"...\" (or --{}=NAME); `fulgur plugins list` shows the {} plugins",
        config.files.empty() ? std::string("the command line") : config.files.front().string(), kind, table, table,
        kind));
  };
  if (!app.make_model && config.model_plugin.name.empty()) throw missing("model", "model");
  if (!app.make_data && config.data_plugin.name.empty()) throw missing("data", "datamodule");
}

// A distributed checkpoint directory (fsdp state_dict_type = "sharded"): the model's names and
// shapes from its metadata alone, as tensors on the meta device (nothing is read or allocated).
c10::impl::GenericDict distributed_checkpoint_state(const std::string& path, const std::string& flag) {
  constexpr std::string_view kPrefix = "state_dict.";
  c10::impl::GenericDict state(c10::StringType::get(), c10::TensorType::get());
  try {
    const dcp::Reader reader(path);
    for (const std::string& key : reader.keys())
      if (key.starts_with(kPrefix) && reader.is_tensor(key))
        state.insert(key.substr(kPrefix.size()),
                     at::empty(reader.shape(key), at::TensorOptions().device(at::kMeta).dtype(reader.dtype(key))));
  } catch (const Error& e) {
    throw UsageError(fmt::format("{}: {}", flag, e.what()));
  }
  if (state.empty())
    throw UsageError(fmt::format(
        "{}: the distributed checkpoint '{}' has no state_dict: it was not written by a Fulgur or Lightning run", flag,
        path));
  return state;
}

// What `fit` says about a file it cannot resume: why, and the key that starts from its weights.
std::string init_weights_hint(const std::string& path) {
  return fmt::format(
      "to start a new fit from its weights, set [trainer] init_weights = \"{}\" (--trainer.init_weights=...; "
      "init_weights_strip_prefix = \"model.\" and the like map its keys) and leave ckpt_path empty",
      path);
}

// A dict of name -> tensor (a torch.save(model.state_dict()) file), or nullopt.
std::optional<c10::impl::GenericDict> bare_state_dict(const c10::IValue& value) {
  if (!value.isGenericDict() || value.toGenericDict().empty()) return std::nullopt;
  for (const auto& entry : value.toGenericDict())
    if (!entry.key().isString() || !entry.value().isTensor()) return std::nullopt;
  return value.toGenericDict();
}

c10::impl::GenericDict as_generic_dict(const TensorMap& tensors) {
  c10::impl::GenericDict state(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : tensors) state.insert(name, t);
  return state;
}

// --ckpt_path to a file: it must exist and hold weights (read once: its state_dict is what
// check_checkpoint_matches compares with the model). For validate, test and predict a safetensors
// file or a bare state dict will do (weights only); `fit` resumes a run and needs a Fulgur
// checkpoint. Checked before the stage starts so that a typo or another model's file costs
// nothing. nullopt for "", "last" and "best".
std::optional<c10::impl::GenericDict> read_checkpoint_state(const std::string& path, const std::string& flag,
                                                            bool resume) {
  if (path.empty() || path == "last" || path == "best") return std::nullopt;
  // On object storage (s3://...): the Trainer checks it once the storage library is loaded.
  if (is_storage_url(path)) return std::nullopt;
  std::error_code ec;
  if (fs::is_directory(path, ec) && dcp::is_distributed_checkpoint(path))
    return distributed_checkpoint_state(path, flag);
  if (!fs::is_regular_file(path, ec))
    throw UsageError(
        fmt::format("{}: no checkpoint at '{}' (give a file, a distributed checkpoint directory, \"last\" or \"best\")",
                    flag, path));
  const auto weights_only = [&](const char* what) {
    return UsageError(
        fmt::format("{}: '{}' holds weights only ({}), and fit resumes a run from a checkpoint with its "
                    "training state; {}",
                    flag, path, what, init_weights_hint(path)));
  };
  try {
    if (detect_weights_format(path) == WeightsFormat::safetensors) {
      if (resume) throw weights_only("safetensors");
      return as_generic_dict(read_weights(path, WeightsFormat::safetensors));
    }
    const c10::IValue ckpt = read_checkpoint_file(path);
    if (!ckpt.isGenericDict() || !ckpt.toGenericDict().contains("state_dict") ||
        !ckpt.toGenericDict().at("state_dict").isGenericDict()) {
      if (auto state = bare_state_dict(ckpt)) {
        if (resume) throw weights_only("a state dict");
        return state;
      }
      throw UsageError(
          fmt::format("{}: '{}' is not a Fulgur or Lightning checkpoint, a state dict of tensors nor a "
                      "safetensors file; `fulgur weights inspect` shows what it holds",
                      flag, path));
    }
    const auto dict = ckpt.toGenericDict();
    if (resume && !dict.contains("fulgur_version")) {
      // Python's Lightning writes its own progress counters under `loops`, not Fulgur's position,
      // data order and RNG state: the run cannot go on exactly where it stopped.
      const auto loops = dict.find("loops");
      const bool fulgur_loops = loops != dict.end() && loops->value().isGenericDict() &&
                                loops->value().toGenericDict().contains("fit_loop") &&
                                loops->value().toGenericDict().at("fit_loop").isGenericDict() &&
                                loops->value().toGenericDict().at("fit_loop").toGenericDict().contains("cpu_rng_state");
      const auto version = dict.find("pytorch-lightning_version");
      if (!fulgur_loops && version != dict.end())
        throw UsageError(fmt::format(
            "{}: '{}' was written by PyTorch Lightning {}, not by Fulgur: its loop state (Lightning's progress "
            "counters, without Fulgur's position, data order and RNG state) cannot be resumed exactly; {}",
            flag, path, version->value().isString() ? version->value().toStringRef() : std::string("?"),
            init_weights_hint(path)));
      if (!fulgur_loops)
        throw UsageError(fmt::format("{}: '{}' holds weights but no training state (no 'loops' entry); {}", flag, path,
                                     init_weights_hint(path)));
    }
    return dict.at("state_dict").toGenericDict();
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(fmt::format("{}: {}", flag, e.what()));
  }
}

// When the file's keys and the model's differ by a prefix ("model.fc1.weight" / "fc1.weight"),
// which init_weights key maps them (the same test as fulgur::load_weights' hint).
std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected,
                        const std::string& path) {
  for (const auto& u : unexpected)
    for (const auto& m : missing) {
      if (u.size() > m.size() && u.ends_with(m) && u[u.size() - m.size() - 1] == '.')
        return fmt::format(
            "; its keys look prefixed: load it with [trainer] init_weights = \"{}\" and "
            "init_weights_strip_prefix = \"{}\" instead",
            path, u.substr(0, u.size() - m.size()));
      if (m.size() > u.size() && m.ends_with(u) && m[m.size() - u.size() - 1] == '.')
        return fmt::format(
            "; the model's keys have a prefix its keys lack: load it with [trainer] init_weights = "
            "\"{}\" and init_weights_add_prefix = \"{}\" instead",
            path, m.substr(0, m.size() - u.size()));
    }
  return {};
}

// With [trainer] strict_loading = false only shapes must match: the restore loads the keys that
// match and warns about the others (checkpoint_connector.cpp).
void check_checkpoint_matches(const c10::impl::GenericDict& state, const std::string& path, const std::string& flag,
                              Module& model, const std::string& model_name, bool strict) {
  std::map<std::string, std::vector<int64_t>> expected;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) expected[p.key()] = p.value().sizes().vec();
  for (const auto& b : model.named_buffers(/*recurse=*/true)) expected[b.key()] = b.value().sizes().vec();
  if (expected.empty()) return;  // layers made in configure_model: the restore itself checks them
  std::vector<std::string> unexpected, mismatched;
  std::set<std::string> seen;
  for (const auto& entry : state) {
    const std::string key = entry.key().toStringRef();
    seen.insert(key);
    auto it = expected.find(key);
    if (it == expected.end())
      unexpected.push_back(key);
    else if (entry.value().isTensor() && entry.value().toTensor().sizes().vec() != it->second)
      mismatched.push_back(key);
  }
  std::vector<std::string> missing;
  for (const auto& [key, shape] : expected)
    if (!seen.count(key)) missing.push_back(key);
  const std::string prefix = prefix_hint(missing, unexpected, path);
  if (!strict) {
    unexpected.clear();
    missing.clear();
  }
  if (unexpected.empty() && missing.empty() && mismatched.empty()) return;
  auto first = [](const std::vector<std::string>& v) { return v.empty() ? std::string() : " (e.g. '" + v[0] + "')"; };
  const std::string hint = !prefix.empty()      ? prefix
                           : mismatched.empty() ? "; [trainer] strict_loading = false loads the weights that match and "
                                                  "leaves the others as the model initialized them"
                                                : "";
  throw UsageError(fmt::format(
      "{}: '{}' holds the weights of another model than {}: {} of its weights are not in the model{}, {} of the "
      "model's are missing from it{}, {} differ in shape{}{}",
      flag, path, model_name, unexpected.size(), first(unexpected), missing.size(), first(missing), mismatched.size(),
      first(mismatched), hint));
}

// Writes the merged config into the run's log directory once the loggers have made it (rank 0).
class SaveConfig : public Callback {
 public:
  explicit SaveConfig(std::string text) : text_(std::move(text)) {}
  HookSet hooks() const override {
    return Hook::fit_start | Hook::validation_start | Hook::test_start | Hook::predict_start;
  }
  void on_fit_start(TrainerContext& t) override { save(t); }
  void on_validation_start(TrainerContext& t) override { save(t); }
  void on_test_start(TrainerContext& t) override { save(t); }
  void on_predict_start(TrainerContext& t) override { save(t); }
  std::string path;

 private:
  void save(TrainerContext& t) {
    if (saved_ || !t.is_global_zero()) return;
    saved_ = true;
    const fs::path dir = t.log_dir();
    std::error_code ec;
    fs::create_directories(dir, ec);
    path = (dir / "config.toml").string();
    atomic_write_text(path, text_);
  }
  std::string text_;
  bool saved_ = false;
};

// A checkpoint file as the saved config's "reproduce" line names it: absolute, so the line works
// from any directory ("last" and "best" stay words).
std::string absolute_ckpt_path(const std::string& path) {
  if (path.empty() || path == "last" || path == "best") return path;
  return fs::absolute(path).lexically_normal().string();
}

std::string saved_config_text(const Config& config, const CliArgs& args, const std::string& program) {
  std::vector<std::string> files;
  for (const auto& f : config.files) files.push_back(f.string());
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string file_list = files.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(files, ", "));
  const std::string flag_list =
      args.flags.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(args.flags, " "));
  std::string header = fmt::format(
      "# The merged config of `{} {}` ({}), every default filled in.\n# Files: {}\n# Flags: {}\n"
      "# Reproduce the run: {} {} --config <this file>{}\n\n",
      fs::path(program).filename().string(), args.subcommand, when, file_list, flag_list,
      fs::path(program).filename().string(), args.subcommand,
      args.ckpt_path && args.subcommand != "fit" ? " --ckpt_path=" + absolute_ckpt_path(*args.ckpt_path) : "");
  return header + to_toml(config);
}

void print_metrics(const std::string& stage, const std::vector<MetricMap>& results) {
  for (size_t i = 0; i < results.size(); ++i) {
    std::printf("%s results%s\n", stage.c_str(), results.size() > 1 ? fmt::format(" (dataloader {})", i).c_str() : "");
    for (const auto& [name, value] : results[i]) std::printf("  %-40s %.6g\n", name.c_str(), value);
  }
  std::fflush(stdout);
}

// `fulgur quantize`: the checkpoint's weights into the model, its fulgur::nn::Linear layers
// quantized (fulgur/nn/linear.h), everything written to one safetensors file whose metadata says
// how, so that `fulgur predict --ckpt_path=<it>` rebuilds the quantized layers before loading.
int quantize_model(const CliArgs& args, const std::string& ckpt, Module& model, const std::string& model_name,
                   const Config& config) {
  if (ckpt.empty() || ckpt == "last" || ckpt == "best")
    throw UsageError(fmt::format("quantize needs --ckpt_path=FILE, the checkpoint or weights file to quantize{}",
                                 ckpt.empty() ? "" : fmt::format(" (not \"{}\": name the file)", ckpt)));
  nn::QuantizeOptions options(nn::weight_quantization_from_string(args.quantize_method));
  if (options.method() == nn::WeightQuantization::none) throw UsageError("--method=none: choose int8 or int4");
  options.group_size(args.quantize_group_size);
  model.configure_model();  // layers a model makes there (Lightning's configure_model is idempotent)
  load_weights(model, ckpt, LoadWeightsOptions().strict(config.trainer.get_bool("strict_loading")));
  // Int8 inputs: layers that learned per-tensor input scales keep them; --activations sets the
  // others (a checkpoint does not say that training quantized its inputs dynamically).
  std::string activations = "none", input_scales;
  std::optional<std::regex> chosen;
  try {
    if (!args.quantize_layers.empty()) chosen.emplace(args.quantize_layers, std::regex::ECMAScript);
  } catch (const std::regex_error&) {
    // quantize_linear_weights below says what is wrong with it
  }
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (!linear || linear->quantization() != nn::WeightQuantization::none ||
        (chosen && !std::regex_search(item.key(), *chosen)))
      continue;
    const nn::QatOptions trained = linear->qat_options();
    if (trained.learnable_scales() && trained.activations() == nn::ActivationQuantization::per_tensor) {
      if (!args.quantize_activations.empty() && args.quantize_activations != "per_tensor")
        throw UsageError(
            fmt::format("--activations={}: layer '{}' learned per-tensor input scales in {}; serve it "
                        "with --activations=per_tensor (or leave the flag out)",
                        args.quantize_activations, item.key(), ckpt));
      activations = "per_tensor";
      input_scales = "learned";
    } else if (!args.quantize_activations.empty()) {
      linear->quantization_aware_training(
          nn::QatOptions(nn::FakeQuantizeOptions(options.method()).group_size(options.group_size()))
              .activations(nn::activation_quantization_from_string(args.quantize_activations))
              .learnable_scales(trained.learnable_scales()));
      activations = args.quantize_activations;
    }
  }
  int64_t bytes_before = 0;
  for (const auto& [name, t] : named_tensors(model)) bytes_before += t.numel() * t.element_size();
  const std::vector<std::string> layers = nn::quantize_linear_weights(model, options, args.quantize_layers);
  if (layers.empty())
    throw UsageError(fmt::format(
        "{} has no fulgur::nn::Linear layer{} to quantize: declare the layers to serve quantized as "
        "fulgur::nn::Linear (fulgur/nn/linear.h; torch::nn::Linear layers cannot change their storage)",
        model_name, args.quantize_layers.empty() ? "" : fmt::format(" matching --layers='{}'", args.quantize_layers)));
  const TensorMap tensors = named_tensors(model);
  int64_t bytes_after = 0;
  for (const auto& [name, t] : tensors) bytes_after += t.numel() * t.element_size();
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {nn::kQuantizationMetadataKey, args.quantize_method},
      {"fulgur.quantized_layers", fmt::format("{}", fmt::join(layers, ","))}};
  if (options.method() == nn::WeightQuantization::int4)
    metadata.emplace("fulgur.group_size", std::to_string(options.group_size()));
  if (activations != "none") metadata.emplace("fulgur.activations", activations);
  if (!input_scales.empty()) metadata.emplace("fulgur.input_scales", input_scales);
  std::string out = args.quantize_out;
  if (out.empty())
    out =
        (fs::path(ckpt).parent_path() / (fs::path(ckpt).stem().string() + "-" + args.quantize_method + ".safetensors"))
            .string();
  save_safetensors(tensors, out, metadata);
  std::printf(
      "quantized %zu layer%s to %s%s: %s\n", layers.size(), layers.size() == 1 ? "" : "s", args.quantize_method.c_str(),
      options.method() == nn::WeightQuantization::int4 ? fmt::format(" (group size {})", options.group_size()).c_str()
                                                       : "",
      fmt::format("{}", fmt::join(layers, ", ")).c_str());
  if (activations != "none")
    std::printf("inputs: int8 %s%s\n", activations.c_str(), input_scales.empty() ? "" : " (learned scales)");
  std::printf("weights: %.2f MB -> %.2f MB (%.2fx smaller)\n", bytes_before / 1e6, bytes_after / 1e6,
              static_cast<double>(bytes_before) / static_cast<double>(std::max<int64_t>(bytes_after, 1)));
  std::printf("wrote %s; serve it with `fulgur predict --config ... --ckpt_path=%s`\n", out.c_str(), out.c_str());
  return 0;
}

int run(const CliApp& app, const CliArgs& args) {
  // 1. The config: files and flags merged, every selected plugin and value checked.
  if (args.configs.empty() && args.overrides.empty() && !args.help)
    throw UsageError(
        fmt::format("{} needs --config FILE (or flags)\n{}", args.subcommand, usage(app.program, args.subcommand)));
  if (args.configs.empty() && args.help) {
    std::fputs(help_text(app, args, nullptr, nullptr).c_str(), stdout);
    return 0;
  }
  std::vector<std::string> overrides = args.overrides;
  // For fit, --ckpt_path is [trainer] ckpt_path (so the saved config resumes the same way).
  if (args.ckpt_path && args.subcommand == "fit") overrides.push_back("trainer.ckpt_path=" + *args.ckpt_path);
  Config config;
  std::unique_ptr<PluginRegistry> registry;
  try {
    config = load_config(args.configs, overrides);
    registry = make_registry(config);
    if (app.make_model && app.model_schema)
      apply_hparams_schema(config, PluginKind::model, *app.model_schema, app.model_type);
    if (app.make_data && app.data_schema)
      apply_hparams_schema(config, PluginKind::datamodule, *app.data_schema, app.data_type);
    if (app.make_model && !config.model_plugin.name.empty())
      throw UsageError(fmt::format("{}: [model] name = \"{}\": this program builds its own model; remove the name",
                                   config.model_plugin.where.str(), config.model_plugin.name));
    if (args.help) {
      validate_plugins(config, *registry);
      std::fputs(help_text(app, args, &config, registry.get()).c_str(), stdout);
      return 0;
    }
    require_user_tables(app, config);
    validate_plugins(config, *registry);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  if (args.print_config) {
    std::fputs(to_toml(config).c_str(), stdout);
    return 0;
  }
  const std::string ckpt =
      args.subcommand == "fit" ? config.trainer.get_string("ckpt_path") : args.ckpt_path.value_or("");
  const std::string ckpt_flag =
      args.ckpt_path ? "--ckpt_path" : fmt::format("{}: [trainer] ckpt_path", config.file.string());

  // 2. The Trainer, then the model (its initial weights follow [trainer] seed) and the data.
  const std::string config_text = saved_config_text(config, args, app.program);
  std::optional<Trainer> trainer_slot;
  UserObjects user;
  try {
    trainer_slot.emplace(config);  // [trainer] values and the plugins' own checks of their options
    user = create_user_objects(app, config, *registry);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  // Read once the Trainer exists: its accelerator may be a plugin device that registers its
  // device type with libtorch then, and the checkpoint's storages name that device ("emu:0").
  std::optional<c10::impl::GenericDict> ckpt_state = read_checkpoint_state(ckpt, ckpt_flag, args.subcommand == "fit");
  Trainer& trainer = *trainer_slot;
  const std::string model_name = app.make_model
                                     ? (app.model_type.empty() ? std::string("this program's model") : app.model_type)
                                     : fmt::format("model '{}'", config.model_plugin.name);
  // Weights `fulgur quantize` wrote: the model's layers take their quantized form before the check
  // (and the stage's load) compares keys and shapes.
  if (ckpt_state && args.subcommand != "quantize" && detect_weights_format(ckpt) == WeightsFormat::safetensors)
    nn::prepare_quantized_layers(*user.model, read_safetensors_header(ckpt).metadata);
  // A checkpoint trained with learned quantization scales (the qat callback's learnable_scales):
  // the layers take those parameters before the check, whatever callbacks this run configures.
  if (ckpt_state) {
    std::map<std::string, at::Tensor> scales;
    for (const auto& entry : *ckpt_state)
      if (entry.value().isTensor() &&
          (entry.key().toStringRef().ends_with("weight_scale") || entry.key().toStringRef().ends_with("input_scale")))
        scales.emplace(entry.key().toStringRef(), entry.value().toTensor());
    if (!scales.empty()) nn::prepare_learned_scales(*user.model, scales);
  }
  if (ckpt_state)
    check_checkpoint_matches(*ckpt_state, ckpt, ckpt_flag, *user.model, model_name,
                             config.trainer.get_bool("strict_loading"));
  ckpt_state.reset();  // the stage reads the file itself; do not hold a second copy of the weights
  if (args.subcommand == "quantize") return quantize_model(args, ckpt, *user.model, model_name, config);
  auto save_config = std::make_shared<SaveConfig>(config_text);
  trainer.add_callback(save_config, "save_config");

  // 3. The stage.
  if (args.subcommand == "fit") {
    trainer.fit(*user.model, *user.data);
  } else if (args.subcommand == "validate") {
    auto results = trainer.validate(*user.model, *user.data, ckpt);
    if (trainer.is_global_zero()) print_metrics("validate", results);
  } else if (args.subcommand == "test") {
    auto results = trainer.test(*user.model, *user.data, ckpt);
    if (trainer.is_global_zero()) print_metrics("test", results);
  } else {
    auto predictions = trainer.predict(*user.model, *user.data, ckpt);
    if (trainer.is_global_zero()) {
      // Where the returned outputs live (the CPU: the loop moves each batch's there).
      std::set<std::string> devices;
      for (const at::Tensor& p : predictions)
        if (p.defined()) devices.insert(p.device().str());
      std::string where;
      for (const std::string& d : devices) where += (where.empty() ? " on " : ", ") + d;
      std::printf("predict: %zu batches%s\n", predictions.size(), where.c_str());
      // Not dropped: a list of one tensor per batch, where the run logs (Python: torch.load(path)).
      if (!predictions.empty()) {
        const fs::path dir = trainer.log_dir();
        std::error_code ec;
        fs::create_directories(dir, ec);
        const std::string file = (dir / "predictions.pt").string();
        c10::impl::GenericList list(c10::AnyType::get());
        for (const at::Tensor& p : predictions) list.push_back(p.defined() ? c10::IValue(p) : c10::IValue());
        write_checkpoint_file(list, file);
        std::printf("predictions: %s (a list of %zu tensors, one per batch; torch.load(path) in Python)\n",
                    file.c_str(), predictions.size());
      } else if (!config.trainer.get_bool("return_predictions")) {
        std::printf(
            "predictions: none collected ([trainer] return_predictions = false); a callback such as "
            "prediction_writer writes them\n");
      }
    }
  }
  if (trainer.is_global_zero()) {
    if (!save_config->path.empty()) std::printf("config: %s\n", save_config->path.c_str());
    std::printf("logs: %s\n", trainer.log_dir().c_str());
  }
  return 0;
}

}  // namespace

bool is_run_subcommand(std::string_view word) {
  for (const auto& s : kSubcommands)
    if (s == word) return true;
  return false;
}

std::vector<OptionSchema> schema_from_specs(const OptionSpec* specs, size_t count) {
  std::vector<OptionSchema> out;
  for (size_t i = 0; i < count; ++i) {
    OptionSchema s;
    s.key = specs[i].key;
    s.type = specs[i].type;
    s.help = specs[i].help;
    if (specs[i].default_value) {
      s.default_text = specs[i].default_value;
      s.default_value = parse_option_default(s.type, s.default_text);
      if (!s.default_value)
        throw Error(ErrorKind::invalid_argument, fmt::format("hyperparameter '{}': default {} is not a valid {}", s.key,
                                                             s.default_text, to_string(s.type)));
    }
    out.push_back(std::move(s));
  }
  return out;
}

int run_cli(int argc, char** argv, const CliApp& app) {
  const std::string program = app.program;
  std::string subcommand = argc > 1 ? argv[1] : "";
  try {
    CliArgs args = parse_cli(argc, argv, program);
    return run(app, args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s %s: error: %s\n", program.c_str(), subcommand.c_str(), e.what());
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "%s %s: error: %s\n", program.c_str(), subcommand.c_str(), e.what());
    return 1;
  } catch (const c10::Error& e) {
    // libtorch's message says what is wrong; its stack frames (where inside libtorch) only at
    // debug level (FULGUR_LOG_LEVEL=debug).
    spdlog::debug("libtorch's stack at the error:\n{}", e.what());
    std::fprintf(stderr, "%s %s: error: %s\n", program.c_str(), subcommand.c_str(), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s %s: internal error: %s\n", program.c_str(), subcommand.c_str(), e.what());
    return 1;
  }
}

}  // namespace fulgur
