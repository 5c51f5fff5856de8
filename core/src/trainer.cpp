// Trainer construction, the capabilities plugins get through TrainerContext, and the stage funnel
// that fit, validate, test and predict share.
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
#include <cmath>
#include <cstdlib>
#include <thread>

#include "distributed/local_launcher.h"
#include "distributed/process_group.h"
#include "trainer_impl.h"

namespace fulgur {

namespace {

double as_number(const OptionValue& v) {
  return std::holds_alternative<int64_t>(v) ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
}

}  // namespace

double parse_max_time(const std::string& text) {
  if (text.empty()) return 0;
  const auto bad = [&] {
    return Error(ErrorKind::config,
                 fmt::format("[trainer] max_time = \"{}\": expected \"DD:HH:MM:SS\" (fewer fields count from the "
                             "right, e.g. \"00:01:30:00\" or \"90:00\")",
                             text));
  };
  std::vector<double> parts;
  size_t start = 0;
  while (true) {
    size_t end = text.find(':', start);
    std::string field = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    try {
      size_t used = 0;
      parts.push_back(std::stod(field, &used));
      if (used != field.size() || !std::isfinite(parts.back()) || parts.back() < 0) throw bad();
    } catch (const std::exception&) {
      throw bad();
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (parts.size() > 4) throw bad();
  const double scale[] = {1, 60, 3600, 86400};
  double seconds = 0;
  for (size_t i = 0; i < parts.size(); ++i) seconds += parts[parts.size() - 1 - i] * scale[i];
  return seconds;
}

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
  for (const char* key : {"accumulate_grad_batches", "log_every_n_steps", "check_val_every_n_epoch", "num_nodes"})
    require(t.get_int(key) >= 1, key, fmt::format("{} = {}: must be >= 1", key, t.get_int(key)));
  for (const char* key : {"fast_dev_run", "min_epochs", "min_steps"})
    require(t.get_int(key) >= 0, key, fmt::format("{} = {}: must be >= 0", key, t.get_int(key)));
  for (const char* key : {"max_epochs", "max_steps"})
    require(t.get_int(key) >= -1, key, fmt::format("{} = {}: must be >= 0, or -1 for no limit", key, t.get_int(key)));
  require(t.get_int("num_sanity_val_steps") >= -1, "num_sanity_val_steps",
          fmt::format("num_sanity_val_steps = {}: must be >= 0, or -1 for all", t.get_int("num_sanity_val_steps")));
  require(t.get_float("gradient_clip_val") >= 0 && std::isfinite(t.get_float("gradient_clip_val")), "gradient_clip_val",
          fmt::format("gradient_clip_val = {}: must be a finite number >= 0", t.get_float("gradient_clip_val")));
  for (const char* key : {"limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                          "overfit_batches", "val_check_interval"}) {
    const OptionValue& v = t.values().at(key);
    const double x = as_number(v);
    require(x >= 0, key, fmt::format("{} = {}: must be >= 0", key, x));
    if (std::holds_alternative<double>(v) && std::string_view(key) != "val_check_interval")
      require(x <= 1.0, key,
              fmt::format("{} = {}: a float is a fraction in [0, 1]; use an integer for a count", key, x));
  }
  {
    const OptionValue& v = t.values().at("val_check_interval");
    require(as_number(v) > 0, "val_check_interval", "val_check_interval must be > 0");
  }
  try {
    parse_max_time(t.get_string("max_time"));
  } catch (const Error& e) {
    auto it = config.trainer_locations.find("max_time");
    throw Error(ErrorKind::config,
                it == config.trainer_locations.end() ? std::string(e.what()) : it->second.str() + ": " + e.what());
  }
  const std::string& devices = t.get_string("devices");
  require(!devices.empty(), "devices", "devices = \"\": give a count, \"auto\", -1 or indices such as \"0,1\"");
  validate_signal_options(config);
  const std::string& level = config.log_level;
  if (!level.empty() && spdlog::level::from_str(level) == spdlog::level::off && level != "off")
    throw Error(ErrorKind::config,
                fmt::format("[logging] level = \"{}\": use trace, debug, info, warn, error, critical or off", level));
}

// ---- construction -------------------------------------------------------------------------------

Trainer::Impl::Impl(Config config) : config_(std::move(config)) {
  validate_trainer_values(config_);
  const Options& t = config_.trainer;
  if (!config_.log_level.empty()) spdlog::set_level(spdlog::level::from_str(config_.log_level));
  root_dir_ = t.get_string("default_root_dir");
  max_epochs_ = t.get_int("max_epochs");
  max_steps_ = t.get_int("max_steps");
  min_epochs_ = t.get_int("min_epochs");
  min_steps_ = t.get_int("min_steps");
  if (max_epochs_ < 0 && max_steps_ < 0) max_epochs_ = 1000;  // Lightning's default
  max_time_seconds_ = t.get_string("max_time").empty() ? -1.0 : parse_max_time(t.get_string("max_time"));
  check_val_every_n_epoch_ = t.get_int("check_val_every_n_epoch");
  num_sanity_val_steps_ = t.get_int("num_sanity_val_steps");
  log_every_n_steps_ = t.get_int("log_every_n_steps");
  accumulate_ = t.get_int("accumulate_grad_batches");
  fast_dev_run_ = t.get_int("fast_dev_run");
  clip_val_ = t.get_float("gradient_clip_val");
  inference_mode_ = t.get_bool("inference_mode");
  detect_anomaly_ = t.get_bool("detect_anomaly");
  clip_algorithm_ =
      t.get_string("gradient_clip_algorithm") == "norm" ? GradClipAlgorithm::norm : GradClipAlgorithm::value;
  if (fast_dev_run_ > 0) {
    max_epochs_ = 1;
    max_steps_ = fast_dev_run_;
    num_sanity_val_steps_ = 0;
  }

  // Seeding here, before the user builds the model, makes initial weights reproducible too.
  if (const int64_t seed = t.get_int("seed"); seed >= 0) torch::manual_seed(static_cast<uint64_t>(seed));
  if (t.get_bool("deterministic")) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);

  plugins_ = connect_plugins(config_, fast_dev_run_ > 0);
  profiler_ptr_ = plugins_.profiler.get();
  for (auto& l : plugins_.loggers) loggers_.push_back(l.get());
  for (auto& entry : plugins_.callbacks) hooks_.add(std::move(entry.callback), std::move(entry.identity));
  plugins_.callbacks.clear();
}

Trainer::Impl::~Impl() {
  // The strategy releases its process group and device once, when the Trainer goes away.
  if (environment_ready_ && plugins_.strategy) {
    try {
      plugins_.strategy->teardown();
    } catch (const std::exception& e) {
      spdlog::warn("strategy teardown failed: {}", e.what());
    }
  }
}

void Trainer::Impl::add_callback(std::shared_ptr<Callback> callback, std::string name) {
  hooks_.add(std::move(callback), PluginIdentity{"callback", std::move(name), {}});
}

// ---- TrainerContext capabilities ---------------------------------------------------------------

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

void Trainer::Impl::log_metrics(const MetricMap& metrics, std::string_view owner) {
  if (loggers_.empty())
    throw Error(ErrorKind::config,
                fmt::format("{}: the Trainer has no logger, so there is nowhere to write its values; add a "
                            "[[loggers]] table (`fulgur plugins list` shows the loggers) or remove the callback",
                            owner));
  if (metrics.empty() || global_rank() != 0) return;
  if (in_train_batch_) {
    // Joins the Trainer's own row for this step (sent at the end of the batch when due).
    for (const auto& [k, v] : metrics) pending_row_[k] = v;
    return;
  }
  // Outside a batch, Lightning's step: the steps taken so far, or at an epoch's end the epoch's
  // last step (where its epoch-level row goes).
  const int64_t step = in_epoch_end_phase_ ? pos_.global_step - 1 : pos_.global_step;
  send_row(metrics, std::max<int64_t>(0, step));
}

const ClusterInfo& Trainer::Impl::cluster() const {
  static const ClusterInfo kSingle;
  return environment_ready_ ? plugins_.strategy->cluster() : kSingle;
}

c10::Device Trainer::Impl::device() const {
  return environment_ready_ ? plugins_.strategy->root_device() : c10::Device(c10::DeviceType::CPU);
}

std::string Trainer::Impl::broadcast(const std::string& value, int64_t src) {
  return environment_ready_ ? plugins_.strategy->broadcast_string(value, src) : value;
}

at::Tensor Trainer::Impl::reduce(const at::Tensor& tensor, ReduceOp op) {
  if (!environment_ready_ || plugins_.strategy->cluster().world_size <= 1) return tensor.detach().clone();
  return plugins_.strategy->reduce(tensor, op);
}

std::vector<at::Tensor> Trainer::Impl::all_gather(const at::Tensor& tensor) {
  if (!environment_ready_) return {tensor.detach().clone()};
  return plugins_.strategy->all_gather(tensor);
}

void Trainer::Impl::barrier(std::string_view name) {
  if (environment_ready_) plugins_.strategy->barrier(name);
}

bool Trainer::Impl::agree(bool decision, bool all) {
  if (!environment_ready_ || plugins_.strategy->cluster().world_size <= 1) return decision;
  return plugins_.strategy->reduce_boolean_decision(decision, all);
}

void Trainer::Impl::synchronize_device() {
  if (environment_ready_) plugins_.accelerator->synchronize(plugins_.strategy->root_device());
}

MetricMap Trainer::Impl::device_stats() const { return plugins_.accelerator->device_stats(device()); }

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

// ---- environment and loggers -------------------------------------------------------------------

void Trainer::Impl::setup_environment_once() {
  if (environment_ready_) return;
  try {
    plugins_.strategy->setup_environment(make_strategy_environment());
  } catch (...) {
    detail::note_local_run_failed();  // children launched for this run must not wait for us
    throw;
  }
  environment_ready_ = true;
}

StrategyEnvironment Trainer::Impl::make_strategy_environment() {
  const std::string spec = config_.trainer.get_string("devices");
  const int64_t num_nodes = config_.trainer.get_int("num_nodes");
  ClusterEnvironment cluster = detect_cluster_environment();
  Strategy& strategy = *plugins_.strategy;
  const bool multi_process = strategy.launches_processes();
  // Under a launcher, "auto" means one device per process of this node.
  const bool automatic = spec == "auto" || spec == "-1";
  StrategyEnvironment env;
  env.accelerator = plugins_.accelerator.get();
  env.devices = plugins_.accelerator->parse_devices(
      cluster.detected() && automatic && multi_process ? std::to_string(cluster.info.local_world_size) : spec);
  if (env.devices.empty())
    throw Error(ErrorKind::config, fmt::format("[trainer] devices = \"{}\" selects no device", spec));

  if (!cluster.detected() && num_nodes > 1)
    throw Error(ErrorKind::config,
                fmt::format("[trainer] num_nodes = {}, but no multi-node launcher started this process (torchrun "
                            "--nnodes, srun, mpirun); start one process per device on every node with one of them, "
                            "or set num_nodes = 1",
                            num_nodes));
  if (!cluster.detected() && multi_process && env.devices.size() > 1) {
    // Lightning's subprocess launcher: the program runs again once per extra device.
    detail::launch_local_processes(static_cast<int64_t>(env.devices.size()));
    cluster = detect_cluster_environment();
  }
  if (cluster.detected()) {
    const int64_t nodes = cluster.info.world_size / std::max<int64_t>(1, cluster.info.local_world_size);
    if (nodes != num_nodes)
      throw Error(ErrorKind::config,
                  fmt::format("[trainer] num_nodes = {}, but {} started {} process(es) in all, {} per node, which is "
                              "{} node(s); set num_nodes = {}",
                              num_nodes, to_string(cluster.kind), cluster.info.world_size,
                              cluster.info.local_world_size, nodes, nodes));
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
                            "alone; use a strategy that launches one process per device (`fulgur plugins list`)",
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
  setup.global_rank = plugins_.strategy->cluster().global_rank;
  for_each_logger("setup", [&](Logger& l) { l.setup(setup); });
  loggers_ready_ = true;
  // Every rank names the run by rank 0's directory (the loggers of other ranks write nothing, and
  // their own version numbering may differ).
  log_dir_ = plugins_.strategy->broadcast_string(loggers_.empty() ? root_dir_ : loggers_.front()->log_dir(), 0);
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
  for_each_logger("log_hyperparams", [&](Logger& l) { l.log_hyperparams(params); });
}

// ---- the stage funnel --------------------------------------------------------------------------

void Trainer::Impl::attach(Module& module, DataModule& data, Stage stage) {
  module_ = &module;
  data_ = &data;
  stage_ = stage;
  hooks_.set_module_name(module.name());
  if (module.hparams.values().empty()) module.hparams = config_.model;
  if (data.hparams.values().empty()) data.hparams = config_.data;
  binding_ = Module::Binding{};
  binding_.strategy = plugins_.strategy.get();
  binding_.precision = plugins_.precision.get();
  binding_.clip_gradients = [this](torch::optim::Optimizer& optimizer, double value, GradClipAlgorithm algorithm) {
    plugins_.strategy->clip_gradients(optimizer, *plugins_.precision, value, algorithm);
  };
  module.bind(&binding_);
  setup_environment_once();
  if (detect_anomaly_) torch::autograd::AnomalyMode::set_enabled(true);
}

void Trainer::Impl::build_model(Module& module, Stage stage) {
  Strategy& strategy = *plugins_.strategy;
  // Lightning's configure_model: layers may be created here, under the strategy (which can build
  // them sharded). It runs for every stage, so it must be idempotent, as in Lightning.
  strategy.configure_model(module, [&] { hooks_.module("configure_model", [&] { module.configure_model(); }); });
  // Device first: the precision plugins pick autocast and kernels from the module's device.
  strategy.setup_module(module);
  plugins_.precision->convert_module(module);
  (void)stage;
}

void Trainer::Impl::setup_optimizers(Module& module) {
  optimizer_configs_ = hooks_.module("configure_optimizers", [&] { return module.configure_optimizers(); });
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers;
  for (auto& cfg : optimizer_configs_) {
    if (!cfg.optimizer)
      throw Error(ErrorKind::invalid_argument, "configure_optimizers() returned an OptimizerConfig without optimizer");
    if (cfg.frequency < 1) throw Error(ErrorKind::invalid_argument, "OptimizerConfig::frequency must be >= 1");
    optimizers.push_back(cfg.optimizer);
  }
  if (module.automatic_optimization && optimizers.size() != 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("automatic optimization needs exactly one optimizer, configure_optimizers() returned {}; "
                            "set automatic_optimization = false to drive several optimizers from training_step",
                            optimizers.size()));
  // The strategy may wrap or replace optimizers (a sharded strategy steps only its shards).
  plugins_.strategy->setup_optimizers(optimizers);
  if (optimizers.size() != optimizer_configs_.size())
    throw Error(ErrorKind::runtime,
                fmt::format("strategy '{}' changed the number of optimizers in setup_optimizers ({} -> {})",
                            config_.strategy.name, optimizer_configs_.size(), optimizers.size()));
  optimizer_ptrs_.clear();
  for (size_t i = 0; i < optimizers.size(); ++i) {
    optimizer_configs_[i].optimizer = optimizers[i];
    optimizer_ptrs_.push_back(optimizers[i].get());
  }
  binding_.optimizers = optimizer_ptrs_;
}

void Trainer::Impl::run_stage(Stage stage, Module& module, DataModule& data, const std::function<void()>& body) {
  attach(module, data, stage);
  RunStatus status = RunStatus::success;
  try {
    Strategy& strategy = *plugins_.strategy;
    if (strategy.cluster().local_rank == 0) data.prepare_data();
    strategy.barrier("prepare_data");
    hooks_.call(Hook::setup, [&](Callback& c) { c.setup(*this, stage); });
    data.setup(stage);
    build_model(module, stage);
    if (stage == Stage::fit) setup_optimizers(module);
    setup_loggers_once();
    if (plugins_.profiler) plugins_.profiler->setup(stage, log_dir(), strategy.cluster().global_rank);
    body();
  } catch (const TrainingInterrupted& stop) {
    // A signal, turned into a checkpoint at a safe point (signal_connector.h): not a failure.
    try {
      finish_stage(stage, RunStatus::interrupted);
    } catch (const std::exception& cleanup) {
      spdlog::error("while stopping on a signal, finishing the {} stage failed: {}", to_string(stage), cleanup.what());
    }
    train_loader_.reset();  // no loader thread may outlive exit's static destructors
    val_loader_.reset();
    exit_interrupted(stop);
  } catch (const std::exception& e) {
    status = RunStatus::failed;
    detail::note_local_run_failed();  // ranks this process launched stop instead of being awaited
    hooks_.call_on_exception([&](Callback& c) { c.on_exception(*this, e); });
    try {
      finish_stage(stage, status);
    } catch (const std::exception& cleanup) {
      spdlog::error("while handling a failure, finishing the {} stage failed too: {}", to_string(stage),
                    cleanup.what());
    }
    throw;
  }
  finish_stage(stage, status);
}

void Trainer::Impl::finish_stage(Stage stage, RunStatus status) {
  // Every step runs even when one fails; the first failure is rethrown at the end.
  std::exception_ptr first;
  auto step = [&](auto&& fn) {
    try {
      fn();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  };
  step([&] { hooks_.call(Hook::teardown, [&](Callback& c) { c.teardown(*this, stage); }); });
  step([&] {
    if (data_) data_->teardown(stage);
  });
  step([&] {
    if (plugins_.profiler) plugins_.profiler->teardown(stage);
  });
  step([&] {
    for_each_logger("save", [&](Logger& l) { l.save(); });
    if (stage == Stage::fit || status != RunStatus::success)
      for_each_logger("finalize", [&](Logger& l) { l.finalize(status); });
  });
  if (module_) module_->bind(nullptr);
  if (first && status == RunStatus::success) std::rethrow_exception(first);
}

// ---- Trainer facade -----------------------------------------------------------------------------

Trainer::Trainer(Config config) : impl_(std::make_unique<Impl>(std::move(config))) {}
Trainer::Trainer(const TrainerOptions& options) : Trainer(options.to_config()) {}
Trainer Trainer::from_toml(const std::filesystem::path& file) { return Trainer(load_config(file)); }
Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

Trainer& Trainer::add_callback(std::shared_ptr<Callback> callback, std::string name) {
  impl_->add_callback(std::move(callback), std::move(name));
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
TrainerContext& Trainer::context() { return *impl_; }
Strategy& Trainer::strategy() { return impl_->strategy(); }
Precision& Trainer::precision() { return impl_->precision(); }

}  // namespace fulgur
