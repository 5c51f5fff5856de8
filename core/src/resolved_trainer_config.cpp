#include "resolved_trainer_config.h"

#include "connectors/signal_connector.h"

#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <filesystem>
#include <system_error>
#include <utility>

namespace fulgur {

namespace {

double as_number(const OptionValue& v) {
  return std::holds_alternative<int64_t>(v) ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
}

}  // namespace

int64_t apply_batch_limit(const OptionValue& limit, int64_t available) {
  if (const auto* count = std::get_if<int64_t>(&limit)) return available < 0 ? *count : std::min(*count, available);
  if (available < 0) return std::get<double>(limit) > 0 ? -1 : 0;
  const double fraction = std::get<double>(limit);
  return static_cast<int64_t>(static_cast<double>(available) * fraction);
}

void validate_trainer_values(const Config& config) {
  const Options& t = config.trainer;
  auto where = [&](std::string_view key) {
    auto it = config.trainer_locations.find(key);
    return it == config.trainer_locations.end() ? std::string("[trainer]") : it->second.str() + ": [trainer]";
  };
  auto require = [&](bool ok, std::string_view key, const std::string& message) {
    if (!ok) throw Error(ErrorKind::config, fmt::format("{} {}", where(key), message));
  };
  const std::string& algorithm = t.get_string("gradient_clip_algorithm");
  require(algorithm == "norm" || algorithm == "value", "gradient_clip_algorithm",
          fmt::format("gradient_clip_algorithm = \"{}\": use \"norm\" or \"value\"", algorithm));
  const std::string& graphs = t.get_string("cuda_graphs");
  require(graphs == "off" || graphs == "on" || graphs == "try", "cuda_graphs",
          fmt::format("cuda_graphs = \"{}\": use \"off\", \"on\" (refuse a step that cannot be captured) or "
                      "\"try\" (train it uncaptured)",
                      graphs));
  for (const char* key : {"accumulate_grad_batches", "log_every_n_steps"})
    require(t.get_int(key) >= 1, key, fmt::format("{} = {}: must be >= 1", key, t.get_int(key)));
  require(t.get_int("num_nodes") >= 0, "num_nodes",
          fmt::format("num_nodes = {}: must be >= 1, or 0 for as many as the launcher started (elastic)",
                      t.get_int("num_nodes")));
  require(t.get_int("check_val_every_n_epoch") >= 0, "check_val_every_n_epoch",
          fmt::format("check_val_every_n_epoch = {}: must be >= 1, or 0 / \"none\" for no epoch condition",
                      t.get_int("check_val_every_n_epoch")));
  if (const std::string& weights = t.get_string("init_weights"); !weights.empty()) {
    std::error_code ec;
    require(std::filesystem::is_regular_file(weights, ec), "init_weights",
            fmt::format("init_weights = \"{}\": no such file (give a checkpoint, a torch.save state dict or a "
                        "safetensors file)",
                        weights));
  }
  const std::string& deterministic = t.get_string("deterministic");
  require(deterministic == "true" || deterministic == "false" || deterministic == "warn", "deterministic",
          fmt::format("deterministic = \"{}\": use true, false or \"warn\"", deterministic));
  for (const char* key : {"fast_dev_run", "min_epochs", "min_steps", "reload_dataloaders_every_n_epochs"})
    require(t.get_int(key) >= 0, key, fmt::format("{} = {}: must be >= 0", key, t.get_int(key)));
  for (const char* key : {"max_epochs", "max_steps"})
    require(t.get_int(key) >= -1, key, fmt::format("{} = {}: must be >= 0, or -1 for no limit", key, t.get_int(key)));
  require(t.get_int("num_sanity_val_steps") >= -1, "num_sanity_val_steps",
          fmt::format("num_sanity_val_steps = {}: must be >= 0, or -1 for all", t.get_int("num_sanity_val_steps")));
  require(t.get_float("gradient_clip_val") >= 0 && std::isfinite(t.get_float("gradient_clip_val")), "gradient_clip_val",
          fmt::format("gradient_clip_val = {}: must be a finite number >= 0", t.get_float("gradient_clip_val")));
  const OptionValue& interval = t.values().at("val_check_interval");
  if (const auto* text = std::get_if<std::string>(&interval)) {
    const std::optional<double> seconds = parse_duration(*text);
    require(seconds && *seconds > 0, "val_check_interval",
            fmt::format("val_check_interval = \"{}\": a wall-clock interval is \"DD:HH:MM:SS\" (fewer fields count "
                        "from the right, e.g. \"00:00:30:00\" or \"90:00\"), longer than zero",
                        *text));
  } else if (t.get_int("check_val_every_n_epoch") == 0) {
    require(std::holds_alternative<int64_t>(interval), "val_check_interval",
            fmt::format("val_check_interval = {}: with check_val_every_n_epoch = \"none\" it must be a number of "
                        "batches (an integer) or a wall-clock interval (\"DD:HH:MM:SS\"), as in Lightning",
                        as_number(interval)));
  }
  for (const char* key : {"limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                          "overfit_batches", "val_check_interval"}) {
    const OptionValue& v = t.values().at(key);
    if (std::holds_alternative<std::string>(v)) continue;  // the wall-clock interval, checked above
    const double x = as_number(v);
    require(x >= 0, key, fmt::format("{} = {}: must be >= 0", key, x));
    if (std::holds_alternative<double>(v) && std::string_view(key) != "val_check_interval")
      require(x <= 1.0, key,
              fmt::format("{} = {}: a float is a fraction in [0, 1]; use an integer for a count", key, x));
  }
  if (!std::holds_alternative<std::string>(interval))
    require(as_number(interval) > 0, "val_check_interval", "val_check_interval must be > 0");
  // max_time is the callback the build marks for it (plugin_connector.cpp); its syntax is checked
  // here, with the one duration parser, so that a bad value names the key before any plugin loads.
  const std::string& max_time = t.get_string("max_time");
  require(max_time.empty() || parse_duration(max_time), "max_time",
          fmt::format("max_time = \"{}\": expected \"DD:HH:MM:SS\" (fewer fields count from the right, e.g. "
                      "\"00:01:30:00\" or \"90:00\")",
                      max_time));
  const std::string& devices = t.get_string("devices");
  require(!devices.empty(), "devices", "devices = \"\": give a count, \"auto\", -1 or indices such as \"0,1\"");
  validate_signal_options(config);
  const std::string& level = config.log_level;
  if (!level.empty() && spdlog::level::from_str(level) == spdlog::level::off && level != "off")
    throw Error(ErrorKind::config,
                fmt::format("[logging] level = \"{}\": use trace, debug, info, warn, error, critical or off", level));
}

ResolvedTrainerConfig ResolvedTrainerConfig::from_config(const Config& config) {
  validate_trainer_values(config);
  const Options& t = config.trainer;
  ResolvedTrainerConfig s;
  s.default_root_dir = t.get_string("default_root_dir");
  if (is_storage_url(s.default_root_dir)) {
    s.default_root_url = std::exchange(s.default_root_dir, t.get_string("staging_dir"));
  } else if (t.get_string("staging_dir") != ".") {
    // A code-built config (ConfigBuilder) can set it beside a local root; a TOML file cannot.
    throw Error(ErrorKind::config,
                fmt::format("[trainer] staging_dir = \"{}\" applies only when default_root_dir is a URL "
                            "(s3://bucket/prefix); default_root_dir = \"{}\" is local",
                            t.get_string("staging_dir"), s.default_root_dir));
  }
  s.max_epochs = t.get_int("max_epochs");
  s.max_steps = t.get_int("max_steps");
  s.min_epochs = t.get_int("min_epochs");
  s.min_steps = t.get_int("min_steps");
  s.check_val_every_n_epoch = t.get_int("check_val_every_n_epoch");
  s.reload_dataloaders_every_n_epochs = t.get_int("reload_dataloaders_every_n_epochs");
  s.num_sanity_val_steps = t.get_int("num_sanity_val_steps");
  s.log_every_n_steps = t.get_int("log_every_n_steps");
  s.accumulate_grad_batches = t.get_int("accumulate_grad_batches");
  s.fast_dev_run = t.get_int("fast_dev_run");
  s.gradient_clip_val = t.get_float("gradient_clip_val");
  s.gradient_clip_algorithm =
      t.get_string("gradient_clip_algorithm") == "norm" ? GradClipAlgorithm::norm : GradClipAlgorithm::value;
  const std::string& graphs = t.get_string("cuda_graphs");
  s.cuda_graphs = graphs == "on" ? StepCaptureMode::on : graphs == "try" ? StepCaptureMode::try_ : StepCaptureMode::off;
  s.inference_mode = t.get_bool("inference_mode");
  s.detect_anomaly = t.get_bool("detect_anomaly");
  s.sync_batchnorm = t.get_bool("sync_batchnorm");
  s.strict_loading = t.get_bool("strict_loading");
  s.async_checkpoint = t.get_bool("async_checkpoint");
  s.init_weights.path = t.get_string("init_weights");
  s.init_weights.strip_prefix = t.get_string("init_weights_strip_prefix");
  s.init_weights.add_prefix = t.get_string("init_weights_add_prefix");
  s.init_weights.strict = t.get_bool("init_weights_strict");
  s.limit_train_batches = t.values().at("limit_train_batches");
  s.limit_val_batches = t.values().at("limit_val_batches");
  s.limit_test_batches = t.values().at("limit_test_batches");
  s.limit_predict_batches = t.values().at("limit_predict_batches");
  s.overfit_batches = t.values().at("overfit_batches");
  s.overfit = as_number(s.overfit_batches) > 0;
  s.use_distributed_sampler = t.get_bool("use_distributed_sampler");
  s.return_predictions = t.get_bool("return_predictions");
  s.val_check_interval = t.values().at("val_check_interval");
  // barebones: no sanity check either (Lightning turns num_sanity_val_steps off with it).
  s.barebones = t.get_bool("barebones");
  if (s.barebones) s.num_sanity_val_steps = 0;
  if (s.fast_dev_run > 0) {
    s.max_epochs = 1;
    s.max_steps = s.fast_dev_run;
    s.num_sanity_val_steps = 0;
  }
  return s;
}

}  // namespace fulgur
