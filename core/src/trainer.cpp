// Trainer construction, the capabilities plugins get through TrainerContext, and the stage funnel
// that fit, validate, test and predict share.
#include <fulgur/cluster_environment.h>
#include <fulgur/communicator.h>
#include <fulgur/error.h>
#include <fulgur/lr_schedulers.h>
#include <fulgur/storage.h>
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
#include <filesystem>
#include <string_view>
#include <thread>

#include "connectors/layer_sync.h"
#include "device_rng.h"
#include "distributed/local_launcher.h"
#include "distributed/process_group.h"
#include "trainer_engine.h"

namespace fulgur {

// ---- construction -------------------------------------------------------------------------------

TrainerEngine::TrainerEngine(Config config)
    : config_(std::move(config)), trainer_config_(ResolvedTrainerConfig::from_config(config_)) {
  const Options& t = config_.trainer;
  if (!config_.log_level.empty()) spdlog::set_level(spdlog::level::from_str(config_.log_level));

  plugins_ = connect_plugins(config_, trainer_config_.fast_dev_run > 0);
  // Seeding here, before the user builds the model, makes initial weights reproducible too. Only
  // after the plugins are loaded: ATen decides its device hooks at the first device query (a seed
  // is one) for the rest of the process, so the accelerator's libraries (libtorch_cuda for the
  // cuda plugin) must be in by then, or that device is off for good. cuda_accelerator_test.cpp
  // ("cuda hooks: ...") runs every entry point to hold this order.
  // The accelerator's own generators too: torch::manual_seed may not reach a plugin backend's.
  if (const int64_t seed = t.get_int("seed"); seed >= 0) {
    torch::manual_seed(static_cast<uint64_t>(seed));
    seed_device_generators(*plugins_.accelerator, static_cast<uint64_t>(seed));
  }
  if (const std::string& deterministic = t.get_string("deterministic"); deterministic != "false") {
    // As Lightning's deterministic=True: torch refuses nondeterministic kernels ("warn": warns
    // about them instead), cuDNN picks deterministic algorithms, and cuBLAS gets the fixed
    // workspace it needs for reproducible GEMMs (read when cuBLAS initialises, later than this; a
    // value the user set is kept).
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/deterministic == "warn");
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  }

  profiler_ptr_ = plugins_.profiler.get();
  std::vector<Logger*> loggers;
  for (auto& l : plugins_.loggers) loggers.push_back(l.get());
  logging_.connect(std::move(loggers), &plugins_.logger_identities);
  for (auto& entry : plugins_.callbacks) hooks_.add(std::move(entry.callback), std::move(entry.identity));
  plugins_.callbacks.clear();
}

TrainerEngine::~TrainerEngine() {
  // The strategy releases its process group and device once, when the Trainer goes away.
  if (environment_ready_ && plugins_.strategy) {
    try {
      plugins_.strategy->teardown();
    } catch (const std::exception& e) {
      spdlog::warn("strategy teardown failed: {}", e.what());
    }
  }
}

void TrainerEngine::add_callback(std::shared_ptr<Callback> callback, std::string name) {
  hooks_.add(std::move(callback), PluginIdentity{"callback", std::move(name), {}});
}

// ---- TrainerContext capabilities ---------------------------------------------------------------

int64_t TrainerEngine::dataloader_idx() const {
  if (stage_ == Stage::fit) return fit_loop_.epoch_loop().val_loop().dataloader_idx();
  return stage_ == Stage::test ? test_loop_.dataloader_idx() : validate_loop_.dataloader_idx();
}

int64_t TrainerEngine::num_batches(Stage stage) const {
  switch (stage) {
    case Stage::fit:
      return fit_loop_.epoch_loop().num_batches();
    case Stage::validate:
    case Stage::sanity_check:
      return stage_ == Stage::fit ? fit_loop_.epoch_loop().val_loop().num_batches() : validate_loop_.num_batches();
    case Stage::test:
      return test_loop_.num_batches();
    default:
      return predict_loop_.num_batches();
  }
}

const ClusterInfo& TrainerEngine::cluster() const {
  static const ClusterInfo kSingle;
  return environment_ready_ ? plugins_.strategy->cluster() : kSingle;
}

c10::Device TrainerEngine::device() const {
  return environment_ready_ ? plugins_.strategy->root_device() : c10::Device(c10::DeviceType::CPU);
}

std::string TrainerEngine::broadcast(const std::string& value, int64_t src) {
  return environment_ready_ ? plugins_.strategy->broadcast_string(value, src) : value;
}

at::Tensor TrainerEngine::reduce(const at::Tensor& tensor, ReduceOp op) {
  if (!environment_ready_ || plugins_.strategy->cluster().world_size <= 1) return tensor.detach().clone();
  return plugins_.strategy->reduce(tensor, op);
}

std::vector<at::Tensor> TrainerEngine::all_gather(const at::Tensor& tensor) {
  if (!environment_ready_) return {tensor.detach().clone()};
  return plugins_.strategy->all_gather(tensor);
}

void TrainerEngine::barrier(std::string_view name) {
  if (environment_ready_) plugins_.strategy->barrier(name);
}

std::vector<std::string> TrainerEngine::scheduler_names() const {
  std::vector<std::string> names;
  for (const OptimizerConfig& cfg : optimizer_configs_)
    names.push_back(cfg.scheduler ? scheduler_keys(*cfg.scheduler).name : std::string());
  return names;
}

bool TrainerEngine::agree(bool decision, bool all) {
  if (!environment_ready_ || plugins_.strategy->cluster().world_size <= 1) return decision;
  return plugins_.strategy->reduce_boolean_decision(decision, all);
}

void TrainerEngine::synchronize_device() {
  if (environment_ready_) plugins_.accelerator->synchronize(plugins_.strategy->root_device());
}

MetricMap TrainerEngine::device_stats() const { return plugins_.accelerator->device_stats(device()); }
std::string TrainerEngine::device_name() const { return plugins_.accelerator->device_name(device()); }
c10::ScalarType TrainerEngine::compute_dtype() const { return plugins_.precision->compute_dtype(); }

void TrainerEngine::set_accumulate_grad_batches(int64_t n) {
  if (n < 1) throw Error(ErrorKind::config, fmt::format("accumulate_grad_batches = {}: must be >= 1", n));
  if (module_ && !module_->automatic_optimization && n != 1)
    throw Error(ErrorKind::config, fmt::format("accumulate_grad_batches = {} is not supported with manual optimization "
                                               "(automatic_optimization = false)",
                                               n));
  if (fit_loop_.epoch_loop().in_batch())
    throw Error(ErrorKind::config,
                "accumulate_grad_batches can change between batches (e.g. in on_train_epoch_start), not inside a "
                "training batch");
  trainer_config_.accumulate_grad_batches = n;
}

void TrainerEngine::request_stop(std::string_view reason) {
  should_stop_ = true;
  stop_reason_ = std::string(reason);
  if (!reason.empty()) spdlog::info("{}", reason);
}

torch::nn::Module& TrainerEngine::model() {
  if (!module_) throw Error(ErrorKind::runtime, "no model is attached: the Trainer is not running a stage");
  return *module_;
}

// ---- environment and loggers -------------------------------------------------------------------

void TrainerEngine::setup_environment_once() {
  if (environment_ready_) return;
  try {
    plugins_.strategy->setup_environment(make_strategy_environment());
  } catch (...) {
    detail::note_local_run_failed();  // children launched for this run must not wait for us
    throw;
  }
  environment_ready_ = true;
}

StrategyEnvironment TrainerEngine::make_strategy_environment() {
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
    if (num_nodes > 0 && nodes != num_nodes)  // 0: an elastic launcher decides how many
      throw Error(ErrorKind::config,
                  fmt::format("[trainer] num_nodes = {}, but {} started {} process(es) in all, {} per node, which is "
                              "{} node(s); set num_nodes = {}",
                              num_nodes, to_string(cluster.kind), cluster.info.world_size,
                              cluster.info.local_world_size, nodes, nodes));
    // torch 2.11's c10d rendezvous, when it shares its store with the workers (the default), hangs
    // when a node joins a running group: the new node waits for the round's MASTER_ADDR, which the
    // others computed once and never write again, and they wait for its torchelastic/role_info.
    const char* shared = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (num_nodes == 0 && cluster.kind == ClusterKind::torchrun && cluster.info.global_rank == 0 && shared &&
        std::string_view(shared) == "True")
      spdlog::warn(
          "num_nodes = 0 (elastic), but torchrun shares its rendezvous store with the workers: with torch 2.11 a node "
          "that joins a running group makes the re-rendezvous time out (DistStoreError on "
          "torchelastic/assigned_ranks); start every torchrun agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that "
          "the group can grow back");
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
  if (cluster.info.world_size > 1)
    spdlog::info("rank {} of {} ({} on this node), started by {}", cluster.info.global_rank, cluster.info.world_size,
                 cluster.info.local_world_size, to_string(cluster.kind));
  const ClusterInfo info = cluster.info;
  env.connect = [this, info](const CommunicatorOptions& options) {
    std::shared_ptr<Communicator> communicator = detail::connect_process_group(info, options);
    world_communicator_ = communicator;
    return communicator;
  };
  return env;
}

// ---- the stage funnel --------------------------------------------------------------------------

void TrainerEngine::attach(Module& module, DataModule& data, Stage stage) {
  module_ = &module;
  data_ = &data;
  stage_ = stage;
  hooks_.set_module_name(module.name());
  hooks_.set_stage(to_string(stage), stage == Stage::fit);
  if (module.hparams.values().empty()) module.hparams = config_.model;
  if (data.hparams.values().empty()) data.hparams = config_.data;
  binding_ = Module::Binding{};
  binding_.strategy = plugins_.strategy.get();
  binding_.precision = plugins_.precision.get();
  binding_.barebones = trainer_config_.barebones;
  binding_.clip_gradients = [this](torch::optim::Optimizer& optimizer, double value, GradClipAlgorithm algorithm) {
    plugins_.strategy->clip_gradients(optimizer, *plugins_.precision, value, algorithm);
  };
  module.bind(&binding_);
  setup_environment_once();
  if (trainer_config_.detect_anomaly) torch::autograd::AnomalyMode::set_enabled(true);
}

void TrainerEngine::build_model(Module& module) {
  Strategy& strategy = *plugins_.strategy;
  // Device first: the precision plugins pick autocast and kernels from the module's device. Then
  // the precision's conversion (a "-true" precision casts every parameter to new storage), and only
  // then the strategy's setup, so that what it keeps of the parameters (fsdp's shards and their
  // dtype, ddp's buckets) is made from the converted ones. A sharded strategy applies the first two
  // to each block the Module marks as built (fulgur::built_block) and shards it at once; the pass
  // over the whole model below then finds those blocks in place (to() and a conversion to the
  // dtype a tensor has already are no-ops that read nothing).
  const auto prepare = [&](torch::nn::Module& part) {
    part.to(strategy.root_device());
    plugins_.precision->convert_module(part);
  };
  // Lightning's configure_model: layers may be created here, under the strategy. It runs for every
  // stage, so it must be idempotent, as in Lightning.
  strategy.configure_model(
      module, ModelBuild{[&] { hooks_.module("configure_model", [&] { module.configure_model(); }); }, prepare});
  prepare(module);
  // Lightning converts batch norms before the strategy wraps the model.
  apply_layer_sync(module, trainer_config_.sync_batchnorm,
                   LayerSyncGroup{world_communicator(), strategy.data_parallel_size(), config_.strategy.name});
  strategy.setup_module(module);
}

void TrainerEngine::setup_optimizers(Module& module) {
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

void TrainerEngine::run_stage(Stage stage, Module& module, DataModule& data, const std::function<void()>& body) {
  attach(module, data, stage);
  RunStatus status = RunStatus::success;
  try {
    Strategy& strategy = *plugins_.strategy;
    if (strategy.cluster().local_rank == 0) data.prepare_data();
    strategy.barrier("prepare_data");
    // Lightning's order: the DataModule, then the callbacks, then the Module (build_model).
    data.setup(stage);
    hooks_.call(Hook::setup, [&](Callback& c) { c.setup(*this, stage); });
    build_model(module);
    if (stage == Stage::fit) setup_optimizers(module);
    logging_.setup_once();
    if (plugins_.profiler) plugins_.profiler->setup(stage, log_dir(), strategy.cluster().global_rank);
    body();
  } catch (const TrainingInterrupted& stop) {
    // A signal, turned into a checkpoint at a safe point (signal_connector.h): not a failure.
    try {
      finish_stage(stage, RunStatus::interrupted);
    } catch (const std::exception& cleanup) {
      spdlog::error("while stopping on a signal, finishing the {} stage failed: {}", to_string(stage), cleanup.what());
    }
    fit_loop_.release_loaders();  // no loader thread may outlive exit's static destructors
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

void TrainerEngine::finish_stage(Stage stage, RunStatus status) {
  // Every step runs even when one fails; the first failure is rethrown at the end.
  std::exception_ptr first;
  auto step = [&](auto&& fn) {
    try {
      fn();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  };
  // The user's optimizer keeps the step counts the fused steps reached (a fit that failed or
  // was interrupted too; one that finished synced before its end hooks).
  step([&] { sync_optimizer_host_state(); });
  fused_adam_.reset();
  // A background save still in flight (a failure or a signal ended the stage) is completed before
  // the process may exit; its own failure is reported beside the one that ended the run.
  try {
    checkpoints_.wait_for_pending_save(/*collective=*/status == RunStatus::success);
  } catch (const std::exception& e) {
    if (status == RunStatus::success) {
      if (!first) first = std::current_exception();
    } else {
      spdlog::error("{}", e.what());
    }
  }
  step([&] { hooks_.call(Hook::teardown, [&](Callback& c) { c.teardown(*this, stage); }); });
  step([&] {
    if (data_) data_->teardown(stage);
  });
  step([&] {
    if (plugins_.profiler) plugins_.profiler->teardown(stage);
  });
  step([&] {
    logging_.save();
    if (stage == Stage::fit || status != RunStatus::success) logging_.finalize(status);
  });
  if (module_) module_->bind(nullptr);
  if (first && status == RunStatus::success) std::rethrow_exception(first);
}

void TrainerEngine::sync_optimizer_host_state() {
  if (fused_adam_) fused_adam_->sync_host_steps();
}

// ---- fit / validate / test / predict -----------------------------------------------------------

void TrainerEngine::fit(Module& module, DataModule& data, const std::string& ckpt_path) {
  // The argument wins; otherwise [trainer] ckpt_path (TOML or ConfigBuilder) applies to fit.
  const std::string configured = ckpt_path.empty() ? config_.trainer.get_string("ckpt_path") : ckpt_path;
  std::string requested = restart_ckpt_path(configured);
  // An elastic torchrun group (num_nodes = 0) that re-formed because a node joined is no restart to
  // torchrun (TORCHELASTIC_RESTART_COUNT stays), yet the job is under way: such a job always
  // resumes from its last checkpoint when one exists, as torchelastic asks of its scripts.
  const bool elastic =
      requested.empty() && config_.trainer.get_int("num_nodes") == 0 && std::getenv("TORCHELASTIC_RUN_ID");
  if (elastic) requested = "last";
  run_stage(Stage::fit, module, data, [&] {
    // torchrun counts restarts per agent, and a group re-formed for a node that joined is no
    // restart at all: the joining node's workers start with TORCHELASTIC_RESTART_COUNT = 0 beside
    // workers that say 1. Every rank resumes when any rank was restarted, or they would train from
    // different states (and the first collective would hang on the mismatch).
    if (configured.empty() && agree(requested == "last", /*all=*/false) && requested.empty()) {
      requested = "last";
      spdlog::info("another rank of this job was restarted, so fit resumes from the last checkpoint here too");
    }
    if (elastic && global_rank() == 0)
      spdlog::info(
          "num_nodes = 0 under torchrun (elastic): fit resumes from the last checkpoint if there is one "
          "(ckpt_path = \"last\")");
    check_manual_optimization(module);
    TrainingEpochLoop& epoch_loop = fit_loop_.epoch_loop();
    // Manual optimization: every optimizer.step() is a global step, as Lightning counts them (a GAN
    // with two optimizers takes two per batch).
    binding_.optimizer_step = [&epoch_loop](torch::optim::Optimizer& optimizer) {
      const bool stepped = epoch_loop.step_optimizer(optimizer);
      epoch_loop.count_manual_optimizer_step();
      return stepped;
    };
    binding_.manual_backward = [&epoch_loop](const at::Tensor& loss) { epoch_loop.manual_backward(loss); };
    const std::string resolved = requested.empty() ? std::string() : checkpoints_.resolve(requested, Stage::fit);
    // setup -> configure_model (run_stage) -> init_weights -> restore -> on_fit_start: a run being
    // resumed keeps its own weights, so init_weights is not even read then.
    std::optional<CheckpointConnector::ReadCheckpoint> checkpoint;
    if (!resolved.empty()) {
      if (global_rank() == 0) {
        spdlog::info(
            "Restoring states from the checkpoint path at {}",
            is_storage_url(resolved) ? resolved : std::filesystem::absolute(resolved).lexically_normal().string());
        if (!trainer_config_.init_weights.path.empty())
          spdlog::info("[trainer] init_weights = \"{}\" is not loaded: the run resumes from {}, whose weights win",
                       trainer_config_.init_weights.path, resolved);
      }
      checkpoint = checkpoints_.read_for_resume(resolved);
      checkpoints_.restore_model(*checkpoint, Stage::fit);
      checkpoints_.restore_callbacks(*checkpoint);
    } else {
      checkpoints_.load_init_weights(Stage::fit);
    }
    hooks_.call(Hook::fit_start, [&](Callback& c) { c.on_fit_start(*this); });
    hooks_.module("on_fit_start", [&] { module.on_fit_start(); });
    if (checkpoint) checkpoints_.restore_training_state(*checkpoint);
    epoch_loop.prepare_optimizer_steps();
    fit_loop_.run();
    // A background save (async_checkpoint) is complete before the end hooks, which may read it.
    checkpoints_.wait_for_pending_save();
    hooks_.call(Hook::fit_end, [&](Callback& c) { c.on_fit_end(*this); });
    hooks_.module("on_fit_end", [&] { module.on_fit_end(); });
    checkpoints_.wait_for_pending_save();
  });
}

std::vector<MetricMap> TrainerEngine::evaluate(Stage stage, Module& module, DataModule& data,
                                               const std::string& ckpt_path) {
  EvaluationLoop& loop = stage == Stage::test ? test_loop_ : validate_loop_;
  MetricMap results;
  size_t num_loaders = 0;
  run_stage(stage, module, data, [&] {
    checkpoints_.restore_model_for(stage, ckpt_path);
    std::vector<int64_t> limits;
    std::vector<std::unique_ptr<BatchLoader>> loaders = stage_loaders(stage, limits);
    std::vector<BatchLoader*> views;
    for (auto& l : loaders) views.push_back(l.get());
    num_loaders = loaders.size();
    loop.set_loaders(std::move(views), std::move(limits));
    logging_.eval_metrics().clear();
    results = loop.run(/*sanity=*/false);
  });
  // Lightning's returned list: one dict per loader with its epoch-level values (no "_epoch"
  // duplicates); with several loaders, each dict holds the values suffixed with its index and
  // those logged outside any loader's batches.
  std::vector<MetricMap> per_loader(std::max<size_t>(1, num_loaders));
  for (const auto& [k, v] : results) {
    if (k.ends_with("_epoch")) continue;
    const size_t at = k.rfind("/dataloader_idx_");
    if (num_loaders > 1 && at != std::string::npos) {
      const size_t index = std::stoul(k.substr(at + 16));
      if (index < per_loader.size()) per_loader[index][k] = v;
    } else {
      for (auto& m : per_loader) m[k] = v;
    }
  }
  return per_loader;
}

std::vector<at::Tensor> TrainerEngine::predict(Module& module, DataModule& data, const std::string& ckpt_path) {
  std::vector<at::Tensor> predictions;
  run_stage(Stage::predict, module, data, [&] {
    checkpoints_.restore_model_for(Stage::predict, ckpt_path);
    std::vector<int64_t> limits;
    std::vector<std::unique_ptr<BatchLoader>> loaders = stage_loaders(Stage::predict, limits);
    predict_loop_.set_num_batches(limits.front());
    predictions = predict_loop_.run(*loaders.front());
  });
  return predictions;
}

void TrainerEngine::check_manual_optimization(const Module& module) const {
  if (module.automatic_optimization) return;
  // The Trainer does not know when the gradients are final; training_step does.
  if (trainer_config_.gradient_clip_val > 0)
    throw Error(ErrorKind::config,
                fmt::format("[trainer] gradient_clip_val = {} is not supported with manual optimization "
                            "(automatic_optimization = false); call clip_gradients(optimizer, value) in "
                            "training_step before optimizer.step()",
                            trainer_config_.gradient_clip_val));
  if (trainer_config_.accumulate_grad_batches != 1)
    throw Error(ErrorKind::config,
                fmt::format("[trainer] accumulate_grad_batches = {} is not supported with manual optimization "
                            "(automatic_optimization = false); step the optimizer every N batches in "
                            "training_step instead",
                            trainer_config_.accumulate_grad_batches));
}

std::vector<std::unique_ptr<BatchLoader>> TrainerEngine::stage_loaders(Stage stage, std::vector<int64_t>& limits) {
  std::vector<std::unique_ptr<BatchLoader>> loaders;
  if (stage == Stage::test)
    loaders = data_->test_loaders();
  else if (stage == Stage::validate)
    loaders = data_->val_loaders();
  else if (auto loader = data_->predict_loader())
    loaders.push_back(std::move(loader));
  const char* name = stage == Stage::test ? "test" : stage == Stage::predict ? "predict" : "val";
  if (loaders.empty())
    throw Error(ErrorKind::invalid_argument,
                stage == Stage::predict
                    ? std::string("the DataModule returned no predict_loader()")
                    : fmt::format("the DataModule returned no {}_loader() for Trainer::{}", name, to_string(stage)));
  const OptionValue& limit = stage == Stage::test      ? trainer_config_.limit_test_batches
                             : stage == Stage::predict ? trainer_config_.limit_predict_batches
                                                       : trainer_config_.limit_val_batches;
  limits.clear();
  for (auto& loader : loaders) {
    if (!loader)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("the DataModule returned a null loader in {}_loaders()", name));
    if (trainer_config_.use_distributed_sampler)
      loader->set_replica(plugins_.strategy->data_parallel_rank(), plugins_.strategy->data_parallel_size());
    int64_t n = apply_batch_limit(limit, loader->num_batches());
    if (trainer_config_.fast_dev_run > 0)
      n = n < 0 ? trainer_config_.fast_dev_run : std::min(n, trainer_config_.fast_dev_run);
    limits.push_back(n);
  }
  return loaders;
}

// ---- shared by the loops ------------------------------------------------------------------------

Batch TrainerEngine::transfer(Batch batch) {
  ProfileScope scope(plugins_.profiler.get(), "transfer_batch_to_device");
  batch =
      hooks_.module("on_before_batch_transfer", [&] { return module_->on_before_batch_transfer(std::move(batch)); });
  batch = hooks_.module("transfer_batch_to_device", [&] {
    return module_->transfer_batch_to_device(std::move(batch), plugins_.strategy->root_device());
  });
  batch = hooks_.module("on_after_batch_transfer", [&] { return module_->on_after_batch_transfer(std::move(batch)); });
  plugins_.precision->convert_input(batch);
  return batch;
}

void TrainerEngine::step_schedulers(SchedulerInterval interval, bool skip_monitored) {
  // Manual optimization steps its schedulers itself (Lightning steps none automatically then).
  if (module_ && !module_->automatic_optimization) return;
  // Lightning's _update_learning_rates: `frequency` counts the epoch's batches (batch_idx + 1, the
  // batch that just stepped; the count restarts every epoch) for step schedulers and epochs for
  // epoch ones. Called before the epoch loop records this batch as done.
  const RunPosition& position = fit_loop_.position();
  const int64_t count =
      interval == SchedulerInterval::step ? fit_loop_.epoch_loop().batches_done_in_epoch() + 1 : position.epoch + 1;
  for (auto& cfg : optimizer_configs_) {
    if (!cfg.scheduler || cfg.interval != interval || count % cfg.frequency != 0) continue;
    if (cfg.monitor.empty()) {
      cfg.scheduler->step();
      continue;
    }
    if (skip_monitored) continue;
    const MetricMap& metrics = callback_metrics();
    auto it = metrics.find(cfg.monitor);
    if (it == metrics.end()) {
      // Lightning's `strict` (fulgur::with_scheduler_keys): an error, or a warning and no step.
      const SchedulerKeys keys = scheduler_keys(*cfg.scheduler);
      const std::string which =
          keys.name.empty() ? "the lr scheduler" : fmt::format("the lr scheduler '{}'", keys.name);
      std::vector<std::string> logged;
      for (const auto& [k, v] : metrics) logged.push_back(k);
      const std::string available = logged.empty() ? "none" : fmt::format("{}", fmt::join(logged, ", "));
      if (keys.strict)
        throw Error(ErrorKind::config,
                    fmt::format("{} monitors '{}', which was never logged. Logged metrics: {}. Log it, change "
                                "OptimizerConfig::monitor, or set strict = false (fulgur::with_scheduler_keys) to "
                                "skip the step instead",
                                which, cfg.monitor, available));
      if (global_rank() == 0)
        spdlog::warn(
            "{} monitors '{}', which is not available, but strict is false: its learning rate is not "
            "updated this time. Logged metrics: {}",
            which, cfg.monitor, available);
      continue;
    }
    cfg.scheduler->step(it->second);
  }
}

// ---- Trainer facade -----------------------------------------------------------------------------

Trainer::Trainer(Config config) : engine_(std::make_unique<TrainerEngine>(std::move(config))) {}
Trainer::Trainer(const ConfigBuilder& options) : Trainer(options.to_config()) {}
Trainer Trainer::from_toml(const std::filesystem::path& file) { return Trainer(load_config(file)); }
Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

Trainer& Trainer::add_callback(std::shared_ptr<Callback> callback, std::string name) {
  engine_->add_callback(std::move(callback), std::move(name));
  return *this;
}
void Trainer::fit(Module& module, DataModule& data, const std::string& ckpt_path) {
  engine_->fit(module, data, ckpt_path);
}
std::vector<MetricMap> Trainer::validate(Module& module, DataModule& data, const std::string& ckpt_path) {
  return engine_->evaluate(Stage::validate, module, data, ckpt_path);
}
std::vector<MetricMap> Trainer::test(Module& module, DataModule& data, const std::string& ckpt_path) {
  return engine_->evaluate(Stage::test, module, data, ckpt_path);
}
std::vector<at::Tensor> Trainer::predict(Module& module, DataModule& data, const std::string& ckpt_path) {
  return engine_->predict(module, data, ckpt_path);
}
void Trainer::save_checkpoint(const std::string& path, bool weights_only) {
  engine_->save_checkpoint(path, weights_only);
}
int64_t Trainer::current_epoch() const { return engine_->current_epoch(); }
int64_t Trainer::global_step() const { return engine_->global_step(); }
const MetricMap& Trainer::callback_metrics() const { return engine_->callback_metrics(); }
const MetricMap& Trainer::logged_metrics() const { return engine_->logged_metrics(); }
bool Trainer::should_stop() const { return engine_->should_stop(); }
const Config& Trainer::config() const { return engine_->config(); }
std::string Trainer::log_dir() const { return engine_->log_dir(); }
int64_t Trainer::global_rank() const { return engine_->global_rank(); }
TrainerContext& Trainer::context() { return *engine_; }
Strategy& Trainer::strategy() { return engine_->strategy(); }
Precision& Trainer::precision() { return engine_->precision(); }

}  // namespace fulgur
