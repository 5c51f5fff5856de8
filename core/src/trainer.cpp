// Trainer construction: config -> validated plugin selections -> plugin objects; the hook index;
// the TrainerContext that plugins see.
#include <fulgur/cluster_environment.h>
#include <fulgur/communicator.h>
#include <fulgur/error.h>
#include <fulgur/trainer.h>

#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "distributed/local_launcher.h"
#include "distributed/process_group.h"
#include "trainer_impl.h"

namespace fulgur {

namespace {

double parse_max_time(const std::string& text) {
  if (text.empty()) return 0;
  // "DD:HH:MM:SS" as in Lightning; fewer fields count from the right (e.g. "01:30:00").
  std::vector<double> parts;
  size_t start = 0;
  while (true) {
    size_t end = text.find(':', start);
    std::string field = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    try {
      size_t used = 0;
      parts.push_back(std::stod(field, &used));
      if (used != field.size()) throw std::invalid_argument(field);
    } catch (const std::exception&) {
      throw Error(ErrorKind::config, fmt::format("[trainer] max_time = \"{}\": expected \"DD:HH:MM:SS\"", text));
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (parts.size() > 4)
    throw Error(ErrorKind::config, fmt::format("[trainer] max_time = \"{}\": expected \"DD:HH:MM:SS\"", text));
  const double scale[] = {1, 60, 3600, 86400};
  double seconds = 0;
  for (size_t i = 0; i < parts.size(); ++i) seconds += parts[parts.size() - 1 - i] * scale[i];
  return seconds;
}

bool is_monitoring_callback(std::string_view name) { return name == "model_checkpoint" || name == "early_stopping"; }

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(ErrorKind::config, message);
}

}  // namespace

int64_t apply_batch_limit(const OptionValue& limit, int64_t available) {
  if (available < 0) return -1;
  if (const auto* count = std::get_if<int64_t>(&limit)) return std::min(*count, available);
  const double fraction = std::get<double>(limit);
  return static_cast<int64_t>(static_cast<double>(available) * fraction);
}

Trainer::Impl::Impl(Config config) : config_(std::move(config)) {
  const Options& t = config_.trainer;
  if (!config_.log_level.empty()) spdlog::set_level(spdlog::level::from_str(config_.log_level));
  root_dir_ = t.get_string("default_root_dir");
  max_epochs_ = t.get_int("max_epochs");
  max_steps_ = t.get_int("max_steps");
  min_epochs_ = t.get_int("min_epochs");
  min_steps_ = t.get_int("min_steps");
  if (max_epochs_ < 0 && max_steps_ < 0) max_epochs_ = 1000;  // Lightning's default
  max_time_seconds_ = parse_max_time(t.get_string("max_time"));
  check_val_every_n_epoch_ = t.get_int("check_val_every_n_epoch");
  num_sanity_val_steps_ = t.get_int("num_sanity_val_steps");
  log_every_n_steps_ = t.get_int("log_every_n_steps");
  accumulate_ = t.get_int("accumulate_grad_batches");
  fast_dev_run_ = t.get_int("fast_dev_run");
  clip_val_ = t.get_float("gradient_clip_val");
  inference_mode_ = t.get_bool("inference_mode");
  detect_anomaly_ = t.get_bool("detect_anomaly");
  const std::string& algorithm = t.get_string("gradient_clip_algorithm");
  require(algorithm == "norm" || algorithm == "value",
          fmt::format("[trainer] gradient_clip_algorithm = \"{}\": use \"norm\" or \"value\"", algorithm));
  clip_algorithm_ = algorithm == "norm" ? GradClipAlgorithm::norm : GradClipAlgorithm::value;
  require(accumulate_ >= 1, fmt::format("[trainer] accumulate_grad_batches = {}: must be >= 1", accumulate_));
  require(log_every_n_steps_ >= 1, fmt::format("[trainer] log_every_n_steps = {}: must be >= 1", log_every_n_steps_));
  require(check_val_every_n_epoch_ >= 1,
          fmt::format("[trainer] check_val_every_n_epoch = {}: must be >= 1", check_val_every_n_epoch_));
  require(clip_val_ >= 0, fmt::format("[trainer] gradient_clip_val = {}: must be >= 0", clip_val_));
  require(fast_dev_run_ >= 0, fmt::format("[trainer] fast_dev_run = {}: must be >= 0", fast_dev_run_));
  for (const char* key : {"limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                          "overfit_batches", "val_check_interval"}) {
    const OptionValue& v = t.values().at(key);
    const double x =
        std::holds_alternative<int64_t>(v) ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
    require(x >= 0, fmt::format("[trainer] {} = {}: must be >= 0", key, x));
    if (std::holds_alternative<double>(v) && std::string_view(key) != "val_check_interval")
      require(x <= 1.0,
              fmt::format("[trainer] {} = {}: a float is a fraction in [0, 1]; use an integer for a count", key, x));
  }
  if (fast_dev_run_ > 0) {
    max_epochs_ = 1;
    max_steps_ = fast_dev_run_;
    num_sanity_val_steps_ = 0;
  }

  // Seeding here, before the user builds the model, makes initial weights reproducible too.
  if (const int64_t seed = t.get_int("seed"); seed >= 0) torch::manual_seed(static_cast<uint64_t>(seed));
  if (t.get_bool("deterministic")) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);

  SearchPathOptions search;
  search.config_paths = config_.plugin_paths;
  RegistryOptions registry_options;
  registry_options.allow_writable = config_.allow_writable_plugins;
  registry_ = std::make_unique<PluginRegistry>(plugin_search_path(search), registry_options);
  for (const auto& p : registry_->problems())
    if (p.is_plugin_error) spdlog::warn("plugin {}: {}", p.file.string(), p.reason);
  create_plugins();
}

void Trainer::Impl::create_plugins() {
  const bool barebones = config_.trainer.get_bool("barebones");
  const bool dev_run = fast_dev_run_ > 0;
  // Every table is checked against its plugin's schema before any plugin code runs.
  validate_plugins(config_, *registry_);

  accelerator_ = plugin_cast<Accelerator>(
      registry_->create(PluginKind::accelerator, config_.accelerator.name, config_.accelerator.options));
  if (!accelerator_->is_available())
    throw Error(ErrorKind::config, fmt::format("{}: accelerator '{}' is not available on this machine",
                                               config_.accelerator.where.str(), config_.accelerator.name));
  strategy_ =
      plugin_cast<Strategy>(registry_->create(PluginKind::strategy, config_.strategy.name, config_.strategy.options));
  precision_ = plugin_cast<Precision>(
      registry_->create(PluginKind::precision, config_.precision.name, config_.precision.options));
  if (config_.profiler && !barebones)
    profiler_ = plugin_cast<Profiler>(
        registry_->create(PluginKind::profiler, config_.profiler->name, config_.profiler->options));
  if (!barebones && !dev_run) {
    for (const auto& sel : config_.loggers)
      logger_objects_.push_back(plugin_cast<Logger>(registry_->create(PluginKind::logger, sel.name, sel.options)));
    if (config_.loggers.empty() && config_.trainer.get_bool("logger")) {
      const Options defaults = default_options(registry_->resolve(PluginKind::logger, "csv").metadata);
      logger_objects_.push_back(plugin_cast<Logger>(registry_->create(PluginKind::logger, "csv", defaults)));
    }
  }
  for (auto& l : logger_objects_) logger_ptrs_.push_back(l.get());
  if (!barebones) {
    for (const auto& sel : config_.callbacks) {
      if (dev_run && is_monitoring_callback(sel.name)) continue;  // fast_dev_run: no checkpoints, no early stop
      add_callback(plugin_cast<Callback>(registry_->create(PluginKind::callback, sel.name, sel.options)), sel.name);
    }
    add_default_callbacks();
  }
}

void Trainer::Impl::add_default_callbacks() {
  auto configured = [&](std::string_view name) {
    for (const auto& slot : callbacks_)
      if (slot.name == name) return true;
    return false;
  };
  auto add_with_defaults = [&](const char* name) {
    const Options options = default_options(registry_->resolve(PluginKind::callback, name).metadata);
    add_callback(plugin_cast<Callback>(registry_->create(PluginKind::callback, name, options)), name);
  };
  const Options& t = config_.trainer;
  if (t.get_bool("enable_progress_bar") && !configured("progress_bar")) add_with_defaults("progress_bar");
  if (t.get_bool("enable_model_summary") && !configured("model_summary") && fast_dev_run_ == 0)
    add_with_defaults("model_summary");
  if (t.get_bool("enable_checkpointing") && !configured("model_checkpoint") && fast_dev_run_ == 0)
    add_with_defaults("model_checkpoint");
}

void Trainer::Impl::add_callback(std::shared_ptr<Callback> callback, std::string name) {
  CallbackSlot slot;
  slot.hooks = callback->hooks();
  slot.callback = std::move(callback);
  slot.monitoring = is_monitoring_callback(name);
  slot.name = std::move(name);
  // Lightning runs checkpoint callbacks last, so they see what every other callback did.
  if (slot.name == "model_checkpoint") {
    callbacks_.push_back(std::move(slot));
  } else {
    auto first_checkpoint = std::find_if(callbacks_.begin(), callbacks_.end(),
                                         [](const CallbackSlot& s) { return s.name == "model_checkpoint"; });
    callbacks_.insert(first_checkpoint, std::move(slot));
  }
  index_hooks();
}

void Trainer::Impl::index_hooks() {
  for (auto& list : by_hook_) list.clear();
  for (const auto& slot : callbacks_)
    for (int bit = 0; bit < 64; ++bit)
      if (slot.hooks & (uint64_t{1} << bit)) by_hook_[bit].push_back(slot.callback.get());
}

void Trainer::Impl::call_epoch_end_split(const std::function<void()>& module_fn) {
  for (const auto& slot : callbacks_)
    if (!slot.monitoring && has_hook(slot.hooks, Hook::train_epoch_end)) slot.callback->on_train_epoch_end(*this);
  module_fn();
  for (const auto& slot : callbacks_)
    if (slot.monitoring && has_hook(slot.hooks, Hook::train_epoch_end)) slot.callback->on_train_epoch_end(*this);
}

int64_t Trainer::Impl::num_batches(Stage stage) const {
  switch (stage) {
    case Stage::fit:
      return num_train_batches_;
    case Stage::validate:
    case Stage::sanity_check:
      return stage_ == Stage::fit ? num_val_batches_ : num_eval_batches_;
    default:
      return num_eval_batches_;
  }
}

const MetricMap& Trainer::Impl::callback_metrics() const {
  // Step values are copied to the host only when someone asks (no sync per training step).
  for (const auto& [k, v] : const_cast<MetricStore&>(train_metrics_).collect_step(false, false, false)) {
    callback_metrics_[k] = v;
    if (k.ends_with("_step")) callback_metrics_[k.substr(0, k.size() - 5)] = v;
  }
  return callback_metrics_;
}

const MetricMap& Trainer::Impl::progress_bar_metrics() const {
  for (const auto& [k, v] : train_metrics_.prog_bar_step_values()) progress_bar_metrics_[k] = v;
  return progress_bar_metrics_;
}

void Trainer::Impl::request_stop(std::string_view reason) {
  should_stop_ = true;
  stop_reason_ = std::string(reason);
  if (!reason.empty()) spdlog::info("{}", reason);
}

std::string Trainer::Impl::log_dir() const {
  if (loggers_ready_) return log_dir_;
  return root_dir_;
}

torch::nn::Module& Trainer::Impl::model() {
  if (!module_) throw Error(ErrorKind::runtime, "no model is attached: the Trainer is not running a stage");
  return *module_;
}

void Trainer::Impl::setup_environment_once() {
  if (environment_ready_) return;
  try {
    strategy_->setup_environment(make_strategy_environment());
  } catch (...) {
    detail::note_local_run_failed();  // children launched for this run must not wait for us
    throw;
  }
  environment_ready_ = true;
}

StrategyEnvironment Trainer::Impl::make_strategy_environment() {
  const std::string spec = config_.trainer.get_string("devices");
  ClusterEnvironment cluster = detect_cluster_environment();
  const bool multi_process = strategy_->launches_processes();
  // Under a launcher, "auto" means one device per process of this node.
  const bool automatic = spec == "auto" || spec == "-1";
  StrategyEnvironment env;
  env.accelerator = accelerator_.get();
  env.devices = accelerator_->parse_devices(
      cluster.detected() && automatic && multi_process ? std::to_string(cluster.info.local_world_size) : spec);
  if (env.devices.empty())
    throw Error(ErrorKind::config, fmt::format("[trainer] devices = \"{}\" selects no device", spec));

  if (!cluster.detected() && multi_process && env.devices.size() > 1) {
    // Lightning's subprocess launcher: the program runs again once per extra device.
    detail::launch_local_processes(static_cast<int64_t>(env.devices.size()));
    cluster = detect_cluster_environment();
  }
  if (cluster.detected() && multi_process && !automatic &&
      static_cast<int64_t>(env.devices.size()) != cluster.info.local_world_size)
    throw Error(ErrorKind::config,
                fmt::format("[trainer] devices = \"{}\" selects {} device(s), but {} started {} process(es) on this "
                            "node; make them match, or set devices = \"auto\"",
                            spec, env.devices.size(), to_string(cluster.kind), cluster.info.local_world_size));
  if (!multi_process && cluster.info.world_size > 1)
    throw Error(ErrorKind::config,
                fmt::format("{} started {} processes, but strategy '{}' runs a single one, so each would train "
                            "alone; use strategy = \"ddp\"",
                            to_string(cluster.kind), cluster.info.world_size, config_.strategy.name));
  env.cluster = cluster.info;

  if (cluster.info.local_world_size > 1) {
    // Processes sharing a node share its cores (torchrun sets OMP_NUM_THREADS=1 for the same
    // reason); the accelerator's `threads` option still wins.
    if (!std::getenv("OMP_NUM_THREADS")) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      at::set_num_threads(std::max(1, cores / static_cast<int>(cluster.info.local_world_size)));
    }
  }
  // Diagnostics come from rank zero only unless FULGUR_LOG_LEVEL asks otherwise.
  if (cluster.info.global_rank != 0 && !std::getenv("FULGUR_LOG_LEVEL")) spdlog::set_level(spdlog::level::warn);
  const ClusterInfo info = cluster.info;
  env.connect = [info](const CommunicatorOptions& options) { return detail::connect_process_group(info, options); };
  return env;
}

void Trainer::Impl::setup_loggers_once() {
  if (loggers_ready_) return;
  LoggerSetup setup;
  setup.root_dir = root_dir_;
  setup.global_rank = strategy_->cluster().global_rank;
  for (Logger* l : logger_ptrs_) l->setup(setup);
  loggers_ready_ = true;
  // Every rank names the run by rank 0's directory (the loggers of other ranks write nothing, and
  // their own version numbering may differ).
  log_dir_ = strategy_->broadcast_string(logger_ptrs_.empty() ? root_dir_ : logger_ptrs_.front()->log_dir(), 0);
  // Hyperparameters of model, data and trainer, flattened with their table as prefix. Model and
  // data come from the objects (attach() fills them from [model] / [data] unless set in code), so
  // hyperparameters a Module sets itself are logged too; the selected accelerator, strategy,
  // precision and profiler add their options.
  std::map<std::string, std::string> params;
  auto add = [&](const std::string& prefix, const Options& options) {
    for (const auto& [k, v] : options.values()) params[prefix + k] = format_option_value(v);
  };
  add("model.", module_ ? module_->hparams : config_.model);
  add("data.", data_ ? data_->hparams : config_.data);
  add("trainer.", config_.trainer);
  add("accelerator.", config_.accelerator.options);
  add("strategy.", config_.strategy.options);
  add("precision.", config_.precision.options);
  if (config_.profiler) {
    params["profiler.name"] = format_option_value(OptionValue(config_.profiler->name));
    add("profiler.", config_.profiler->options);
  }
  for (Logger* l : logger_ptrs_) l->log_hyperparams(params);
}

void Trainer::Impl::attach(Module& module, DataModule& data, Stage stage) {
  module_ = &module;
  data_ = &data;
  stage_ = stage;
  if (module.hparams.values().empty()) module.hparams = config_.model;
  if (data.hparams.values().empty()) data.hparams = config_.data;
  binding_ = Module::Binding{};
  binding_.strategy = strategy_.get();
  binding_.precision = precision_.get();
  module.bind(&binding_);
  setup_environment_once();
  if (detect_anomaly_) torch::autograd::AnomalyMode::set_enabled(true);
}

void Trainer::Impl::finish_stage(Stage stage, RunStatus status) {
  call(Hook::teardown, [&](Callback& c) { c.teardown(*this, stage); });
  if (data_) data_->teardown(stage);
  if (profiler_) {
    profiler_->teardown(stage);
  }
  for (Logger* l : logger_ptrs_) {
    l->save();
    if (stage == Stage::fit || status != RunStatus::success) l->finalize(status);
  }
  if (module_) module_->bind(nullptr);
}

// ---- Trainer facade -----------------------------------------------------------------------------

Trainer::Trainer(Config config) : impl_(std::make_unique<Impl>(std::move(config))) {}
Trainer Trainer::from_toml(const std::filesystem::path& file) { return Trainer(load_config(file)); }
Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

Trainer& Trainer::add_callback(std::shared_ptr<Callback> callback) {
  impl_->add_callback(std::move(callback), "user");
  return *this;
}
void Trainer::fit(Module& module, DataModule& data, const std::string& ckpt_path) {
  impl_->fit(module, data, ckpt_path);
}
std::vector<MetricMap> Trainer::validate(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->evaluate(Stage::validate, module, data, ckpt_path);
}
std::vector<MetricMap> Trainer::test(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->evaluate(Stage::test, module, data, ckpt_path);
}
std::vector<at::Tensor> Trainer::predict(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->predict(module, data, ckpt_path);
}
void Trainer::save_checkpoint(const std::string& path, bool weights_only) {
  impl_->save_checkpoint(path, weights_only);
}
int64_t Trainer::current_epoch() const { return impl_->current_epoch(); }
int64_t Trainer::global_step() const { return impl_->global_step(); }
const MetricMap& Trainer::callback_metrics() const { return impl_->callback_metrics(); }
const MetricMap& Trainer::logged_metrics() const { return impl_->logged_metrics(); }
bool Trainer::should_stop() const { return impl_->should_stop(); }
const Config& Trainer::config() const { return impl_->config(); }
std::string Trainer::log_dir() const { return impl_->log_dir(); }
int64_t Trainer::global_rank() const { return impl_->global_rank(); }

}  // namespace fulgur
