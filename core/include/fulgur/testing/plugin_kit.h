// The plugin testing kit, Trainer side: a boring model and data, a plugin created from its built
// library through the real C door (as the Trainer does), and conformance checks per plugin kind
// that every plugin should pass. Fulgur's built-in plugins are tested with this header; so is
// examples/third_party_plugin. Header-only; include it only in tests (it pulls in torch::nn).
//
//   auto guard = fulgur::testing::create_plugin<fulgur::Callback>(
//       fulgur::PluginKind::callback, "divergence_guard", {{"limit", 10.0}}, {"build"});
//   fulgur::testing::check_callback_conformance(guard.get());   // throws std::runtime_error
//
// The checks throw std::runtime_error saying what failed, so any test framework can use them; one
// per plugin kind (check_callback/logger/strategy/accelerator/precision/profiler/storage_conformance).
#pragma once

#include <fulgur/accelerator.h>
#include <fulgur/callback.h>
#include <fulgur/config_builder.h>
#include <fulgur/data_module.h>
#include <fulgur/logger.h>
#include <fulgur/module.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/registry/registry.h>
#include <fulgur/storage.h>
#include <fulgur/strategy.h>
#include <fulgur/testing.h>
#include <fulgur/trainer.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fulgur::testing {

// Lightning's BoringModel: one linear layer, 32 inputs -> 2 outputs, SGD; logs train/loss,
// val/loss and test/loss.
struct BoringModule : Module {
  BoringModule() { layer = register_module("layer", torch::nn::Linear(32, 2)); }
  StepOutput training_step(const Batch& batch, int64_t) override {
    at::Tensor loss = layer->forward(batch.input).pow(2).mean();
    log("train/loss", loss);
    return {loss};
  }
  StepOutput validation_step(const Batch& batch, int64_t) override {
    log("val/loss", layer->forward(batch.input).pow(2).mean());
    return {};
  }
  StepOutput test_step(const Batch& batch, int64_t) override {
    log("test/loss", layer->forward(batch.input).pow(2).mean());
    return {};
  }
  at::Tensor predict_step(const Batch& batch, int64_t) override { return layer->forward(batch.input); }
  std::vector<OptimizerConfig> configure_optimizers() override {
    return {OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1)))};
  }
  torch::nn::Linear layer{nullptr};
};

/// The rows of `inputs` and `targets` in order, in batches of `batch_size`. With several replicas,
/// as torch's DistributedSampler without shuffling: padded by wrapping around to an equal count,
/// replica r takes rows r, r + R, r + 2R, ... (the engine's own interface only: the kit needs no
/// data library).
class BoringLoader final : public BatchLoader {
 public:
  BoringLoader(at::Tensor inputs, at::Tensor targets, int64_t batch_size)
      : inputs_(std::move(inputs)), targets_(std::move(targets)), batch_size_(batch_size) {}
  int64_t num_batches() const override { return (rows_per_replica() + batch_size_ - 1) / batch_size_; }
  void start_epoch(int64_t, int64_t skip_batches) override {
    const int64_t total = inputs_.size(0), padded = rows_per_replica() * replicas_;
    at::Tensor order = at::arange(padded, at::kLong).remainder(total);
    rows_ = order.slice(0, rank_, padded, replicas_);
    next_ = std::min(skip_batches, num_batches());
  }
  std::optional<Batch> next() override {
    if (next_ >= num_batches()) return std::nullopt;
    const int64_t begin = next_++ * batch_size_;
    const at::Tensor idx = rows_.slice(0, begin, std::min(begin + batch_size_, rows_.size(0)));
    Batch b;
    b.input = inputs_.index_select(0, idx);
    b.target = targets_.index_select(0, idx);
    return b;
  }
  void set_replica(int64_t rank, int64_t num_replicas) override {
    rank_ = rank;
    replicas_ = std::max<int64_t>(1, num_replicas);
  }

 private:
  int64_t rows_per_replica() const { return (inputs_.size(0) + replicas_ - 1) / replicas_; }
  at::Tensor inputs_, targets_, rows_;
  int64_t batch_size_, rank_ = 0, replicas_ = 1, next_ = 0;
};

// 64 random samples of 32 features in batches of `batch_size`, for every stage.
struct BoringData : DataModule {
  explicit BoringData(int64_t batch_size = 8) : batch_size(batch_size) {
    inputs = at::randn({64, 32});
    targets = at::zeros({64}, at::kLong);
  }
  std::unique_ptr<BatchLoader> train_loader() override { return loader(); }
  std::unique_ptr<BatchLoader> val_loader() override { return loader(); }
  std::unique_ptr<BatchLoader> test_loader() override { return loader(); }
  std::unique_ptr<BatchLoader> predict_loader() override { return loader(); }
  std::unique_ptr<BatchLoader> loader() const { return std::make_unique<BoringLoader>(inputs, targets, batch_size); }
  int64_t batch_size;
  at::Tensor inputs, targets;
};

// The registry a test creates plugins with: `directories` first (a plugin's build directory),
// then the usual search path (FULGUR_PLUGIN_PATH, the user and install directories).
inline PluginRegistry& registry_for(const std::vector<std::string>& directories = {}) {
  static std::map<std::vector<std::string>, std::unique_ptr<PluginRegistry>> registries;
  auto& slot = registries[directories];
  if (!slot) {
    SearchPathOptions search;
    for (const auto& d : directories) search.config_paths.emplace_back(d);
    RegistryOptions options;
    options.allow_writable = true;  // build directories are often group-writable
    slot = std::make_unique<PluginRegistry>(plugin_search_path(search), options);
  }
  return *slot;
}

// The plugin's options as a config file would give them: every schema default, then `overrides`.
inline Options plugin_options(PluginKind kind, std::string_view name,
                              const std::vector<std::pair<std::string, OptionValue>>& overrides = {},
                              const std::vector<std::string>& directories = {}) {
  const PluginCandidate& candidate = registry_for(directories).resolve(kind, name);
  Options options(std::string(to_string(kind)) + " '" + std::string(name) + "'");
  for (const auto& option : candidate.metadata.options)
    if (option.default_value) options.set(option.key, *option.default_value);
  for (const auto& [key, value] : overrides) {
    if (candidate.metadata.find_option(key) == nullptr)
      throw std::runtime_error(std::string(name) + " has no option '" + key + "'");
    options.set(key, value);
  }
  return options;
}

// The plugin created from its library, exactly as the Trainer creates it.
template <class T>
std::shared_ptr<T> create_plugin(PluginKind kind, std::string_view name,
                                 const std::vector<std::pair<std::string, OptionValue>>& overrides = {},
                                 const std::vector<std::string>& directories = {}) {
  return plugin_cast<T>(
      registry_for(directories).create(kind, name, plugin_options(kind, name, overrides, directories)));
}

namespace detail {
inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("conformance: " + what);
}
inline std::string temp_directory() {
  std::string pattern = (std::filesystem::temp_directory_path() / "fulgur-conformance-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}
}  // namespace detail

// A callback: its state survives state_dict -> load_state_dict; it goes through fit, validate,
// test and predict of a real Trainer (with its default logger and no other callbacks) without throwing
// and without stopping the 2 epochs of 8 batches early.
inline void check_callback_conformance(const std::shared_ptr<Callback>& callback) {
  c10::IValue state;
  callback->state_dict(state);
  if (!callback->state_key().empty()) callback->load_state_dict(state);

  const std::string root = detail::temp_directory();
  Trainer trainer(ConfigBuilder()
                      .set("default_root_dir", root)
                      .set("max_epochs", int64_t{2})
                      .set("enable_progress_bar", false)
                      .set("enable_model_summary", false)
                      .set("enable_checkpointing", false));
  auto recorder = std::make_shared<RecordingCallback>();
  trainer.add_callback(callback, "under test");
  trainer.add_callback(recorder, "recorder");
  BoringModule module;
  BoringData data;
  trainer.fit(module, data);
  trainer.validate(module, data);
  trainer.test(module, data);
  trainer.predict(module, data);
  detail::expect(recorder->count("on_train_batch_end") == 16, "fit ran 2 epochs of 8 batches");
  detail::expect(trainer.global_step() == 16, "the callback let fit take its 16 steps");
}

// A logger: setup creates its run directory under root_dir; metrics, hyperparameters, save and
// finalize go through; log_dir() names an existing directory.
inline void check_logger_conformance(const std::shared_ptr<Logger>& logger) {
  const std::string root = detail::temp_directory();
  logger->setup(LoggerSetup{root, 0});
  logger->log_hyperparams({{"model.lr", "0.1"}, {"trainer.max_epochs", "2"}});
  for (int64_t step = 0; step < 3; ++step) logger->log_metrics({{"train/loss", 1.0 / (step + 1)}}, step);
  logger->save();
  logger->finalize(RunStatus::success);
  struct stat info {};
  detail::expect(::stat(logger->log_dir().c_str(), &info) == 0 && S_ISDIR(info.st_mode),
                 "log_dir() '" + logger->log_dir() + "' exists after setup");
  detail::expect(logger->log_dir().rfind(root, 0) == 0, "log_dir() lies under the root_dir given to setup");
}

// A strategy in one process: collectives are identities, the module trains, and a checkpoint's
// parts written by save_checkpoint come back equal through load_checkpoint.
inline void check_strategy_conformance(const std::shared_ptr<Strategy>& strategy) {
  StrategyEnvironment environment;
  environment.devices = {c10::Device(c10::DeviceType::CPU)};
  strategy->setup_environment(environment);
  detail::expect(strategy->cluster().world_size == 1, "one process: world size 1");
  const at::Tensor t = at::randn({3});
  detail::expect(strategy->reduce(t, ReduceOp::sum).equal(t), "reduce is the identity in one process");
  detail::expect(strategy->all_gather(t).size() == 1, "all_gather gives one tensor in one process");
  detail::expect(strategy->broadcast_string("x", 0) == "x", "broadcast_string is the identity");
  detail::expect(strategy->reduce_boolean_decision(true, true), "a decision of one is its own");

  BoringModule module;
  strategy->configure_model(module,
                            ModelBuild{[] {}, [&](torch::nn::Module& part) { part.to(strategy->root_device()); }});
  strategy->setup_module(module);
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers{
      std::make_shared<torch::optim::SGD>(module.parameters(), torch::optim::SGDOptions(0.1))};
  strategy->setup_optimizers(optimizers);
  detail::expect(optimizers.size() == 1 && optimizers[0], "setup_optimizers keeps one optimizer per entry");

  const std::string root = detail::temp_directory();
  const std::string path = root + "/conformance.ckpt";
  c10::IValue model_state = strategy->module_state_dict(module);
  std::vector<c10::IValue> optimizer_states{strategy->optimizer_state_dict(*optimizers[0])};
  c10::impl::GenericDict metadata(c10::StringType::get(), c10::AnyType::get());
  metadata.insert("global_step", int64_t{7});
  c10::IValue metadata_value(metadata);
  strategy->save_checkpoint(CheckpointParts{&model_state, &optimizer_states, &metadata_value}, path);
  detail::expect(strategy->is_checkpoint(path), "is_checkpoint() recognises what save_checkpoint wrote");

  c10::IValue model_back, metadata_back;
  std::vector<c10::IValue> optimizers_back;
  strategy->load_checkpoint(path, CheckpointParts{&model_back, &optimizers_back, &metadata_back});
  detail::expect(optimizers_back.size() == 1, "one optimizer state comes back");
  detail::expect(metadata_back.isGenericDict() && metadata_back.toGenericDict().at("global_step").toInt() == 7,
                 "metadata comes back");
  const auto before = module.layer->weight.detach().clone();
  {
    at::NoGradGuard no_grad;
    module.layer->weight.add_(1.0);
  }
  strategy->load_module_state_dict(module, model_back, /*strict=*/true, path);
  detail::expect(module.layer->weight.equal(before), "load_module_state_dict restores the saved weights");
  strategy->teardown();
}

// An accelerator: when it says it is available, "1" selects one device of its type, that device
// can be set up and synchronized, and its statistics are finite numbers. When it is not available,
// selecting a device fails with a fulgur::Error (a message, not a crash).
inline void check_accelerator_conformance(const std::shared_ptr<Accelerator>& accelerator) {
  if (!accelerator->is_available()) {
    bool refused = false;
    try {
      accelerator->parse_devices("1");
    } catch (const Error&) {
      refused = true;
    }
    detail::expect(refused, "an unavailable accelerator refuses devices = \"1\" with a fulgur::Error");
    return;
  }
  detail::expect(accelerator->device_count() >= 1, "an available accelerator counts at least one device");
  const std::vector<c10::Device> devices = accelerator->parse_devices("1");
  detail::expect(devices.size() == 1 && devices[0].type() == accelerator->device_type(),
                 "devices = \"1\" selects one device of the accelerator's type");
  accelerator->setup_device(devices[0]);
  accelerator->synchronize(devices[0]);
  for (const auto& [name, value] : accelerator->device_stats(devices[0]))
    detail::expect(std::isfinite(value), "device_stats '" + name + "' is a finite number");
  detail::expect(!accelerator->default_collective_backend().empty(), "a collective backend is named");
  accelerator->teardown();
}

// A precision plugin: a module converted by it trains one SGD step inside its forward scope (the
// loss goes down on the same batch), and its state survives state_dict -> load_state_dict.
inline void check_precision_conformance(const std::shared_ptr<Precision>& precision) {
  BoringModule module;
  precision->convert_module(module);
  auto optimizer = std::make_shared<torch::optim::SGD>(module.parameters(), torch::optim::SGDOptions(0.1));
  Batch batch;
  batch.input = at::randn({8, 32});
  batch.target = at::zeros({8}, at::kLong);
  precision->convert_input(batch);
  auto loss_of = [&] {
    PrecisionScope scope(*precision);
    return module.layer->forward(batch.input).pow(2).mean();
  };
  const at::Tensor before = loss_of();
  optimizer->zero_grad();
  precision->scale_loss(before).backward();
  precision->unscale_gradients(*optimizer);
  precision->clip_gradients(*optimizer, 1.0, GradClipAlgorithm::norm);
  detail::expect(precision->optimizer_step(*optimizer), "a step with finite gradients is taken");
  const at::Tensor after = loss_of();
  detail::expect(after.item<double>() < before.item<double>(), "the loss decreases after one step");
  c10::IValue state;
  precision->state_dict(state);
  precision->load_state_dict(state);
}

// A profiler: the Trainer's actions can be started and stopped (nested too) between setup and
// teardown over several steps with real tensor work inside, and it has a summary to show.
inline void check_profiler_conformance(const std::shared_ptr<Profiler>& profiler) {
  const std::string root = detail::temp_directory();
  profiler->setup(Stage::fit, root, 0);
  at::Tensor x = at::randn({32, 32});
  for (int i = 0; i < 8; ++i) {
    profiler->start("run_training_batch");
    profiler->start("training_step");
    x = x.mm(x).tanh();
    profiler->stop("training_step");
    profiler->stop("run_training_batch");
  }
  const std::string summary = profiler->summary();
  profiler->teardown(Stage::fit);
  detail::expect(!summary.empty(), "summary() has something to show after 8 profiled steps");
}

// A storage plugin (SDK 1.5): fulgur::Storage's contract on real objects below `prefix` (a local
// directory, or a URL of the plugin's scheme; it should hold nothing below "kit/" yet; a URL
// storage must accept a key whose "folders" were never written, as object stores do): a write
// reads back whole and by range (inside, and across the end: fewer bytes), replaces atomically,
// shows in stat() and in list() of its "directory" (a sibling that only shares the characters does
// not), and every URL list() returns reads back; 3 MiB of non-text bytes survive a round trip;
// remove() answers true then false; a missing object is absent from stat() and its read throws
// fulgur::Error. Everything it wrote is removed again.
inline void check_storage_conformance(const std::shared_ptr<Storage>& storage, const std::string& prefix) {
  Storage& s = *storage;
  const std::string dir = join_storage_path(prefix, "kit/");
  const std::string a = dir + "a.bin";
  const std::string nested = dir + "sub/c.bin";
  const std::string sibling = join_storage_path(prefix, "kitten.bin");
  const std::string big = dir + "big.bin";
  // Local files need their directory; an object store makes a key's "folders" as it writes it.
  if (!is_storage_url(prefix)) std::filesystem::create_directories(dir + "sub");
  s.write(a, "0123456789");
  s.write(nested, "x");
  s.write(sibling, "sibling");
  detail::expect(s.read(a) == "0123456789", "read() returns what write() stored");
  detail::expect(s.read_range(a, 3, 4) == "3456", "read_range(3, 4) returns bytes 3..6");
  detail::expect(s.read_range(a, 8, 10) == "89", "read_range across the end returns the bytes up to the end");
  const std::optional<StorageObject> info = s.stat(a);
  detail::expect(info && info->size == 10, "stat() of a 10-byte object says 10 bytes");
  detail::expect(info && info->modified_ns > 0, "stat() gives the time the object was completed");
  detail::expect(s.exists(a) && s.exists(nested), "exists() after write()");
  std::vector<std::string> listed;
  for (const StorageObject& o : s.list(dir)) listed.push_back(o.url);
  std::sort(listed.begin(), listed.end());
  detail::expect(listed == std::vector<std::string>{a, nested},
                 "list(\"" + dir + "\") returns exactly the two objects below it, nested ones included, as URLs");
  for (const std::string& url : listed) (void)s.read(url);
  s.write(a, "new");
  detail::expect(s.read(a) == "new" && s.stat(a)->size == 3, "a second write() replaces the object");
  std::string bytes(3u << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
  s.write(big, bytes);
  detail::expect(s.read(big) == bytes, "3 MiB of binary bytes read back unchanged");
  detail::expect(s.read_range(big, (2u << 20) + 5, 7) == bytes.substr((2u << 20) + 5, 7),
                 "read_range deep inside a large object");
  detail::expect(s.remove(a), "remove() of an existing object answers true");
  detail::expect(!s.remove(a), "remove() of a missing object answers false");
  detail::expect(!s.stat(a) && !s.exists(a), "a removed object is gone from stat()");
  bool threw = false;
  try {
    (void)s.read(a);
  } catch (const Error&) {
    threw = true;
  }
  detail::expect(threw, "read() of a missing object throws fulgur::Error");
  for (const std::string& url : {nested, sibling, big}) s.remove(url);
  detail::expect(s.list(dir).empty(), "list() is empty once everything below it is removed");
}

}  // namespace fulgur::testing
