// Checkpoints: Lightning's top-level keys in an ordinary PyTorch zip archive (Python's
// torch.load(path, weights_only=True) opens it), Python-style dotted parameter names, optimizer
// states in Python's layout for the common optimizers, and everything exact resume needs
// (loop position, RNG, scheduler and precision state).
#include <fulgur/error.h>
#include <fulgur/state_dict.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <sstream>

#include "trainer_impl.h"

namespace fulgur {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFulgurVersion = "0.1.0";

c10::impl::GenericDict string_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }
c10::impl::GenericList any_list() { return c10::impl::GenericList(c10::AnyType::get()); }

c10::IValue to_ivalue(const OptionValue& v) {
  struct Visitor {
    c10::IValue operator()(bool b) const { return b; }
    c10::IValue operator()(int64_t i) const { return i; }
    c10::IValue operator()(double d) const { return d; }
    c10::IValue operator()(const std::string& s) const { return s; }
    c10::IValue operator()(const std::vector<std::string>& l) const {
      auto list = any_list();
      for (const auto& s : l) list.push_back(s);
      return list;
    }
    c10::IValue operator()(const std::vector<double>& l) const {
      auto list = any_list();
      for (double d : l) list.push_back(d);
      return list;
    }
  };
  return std::visit(Visitor{}, v);
}

c10::impl::GenericDict options_dict(const Options& options) {
  auto dict = string_dict();
  for (const auto& [k, v] : options.values()) dict.insert(k, to_ivalue(v));
  return dict;
}

c10::impl::GenericDict as_dict(const c10::IValue& v, const std::string& what, const std::string& path) {
  if (!v.isGenericDict())
    throw Error(ErrorKind::checkpoint,
                fmt::format("checkpoint {}: '{}' is not a dict; the file is not a Fulgur/Lightning "
                            "checkpoint",
                            path, what));
  return v.toGenericDict();
}

std::optional<c10::IValue> get(const c10::impl::GenericDict& d, const std::string& key) {
  auto it = d.find(key);
  if (it == d.end()) return std::nullopt;
  return it->value();
}

c10::IValue require_key(const c10::impl::GenericDict& d, const std::string& key, const std::string& path,
                        const std::string& hint) {
  auto v = get(d, key);
  if (!v) throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: key '{}' is missing; {}", path, key, hint));
  return *v;
}

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

c10::IValue Trainer::Impl::dump_metadata(bool weights_only) {
  auto ckpt = string_dict();
  ckpt.insert("epoch", pos_.epoch);
  ckpt.insert("global_step", pos_.global_step);
  ckpt.insert("pytorch-lightning_version", "2.6.0");  // the layout this file follows
  ckpt.insert("fulgur_version", kFulgurVersion);

  auto fit_loop = string_dict();
  fit_loop.insert("epoch", pos_.epoch);
  fit_loop.insert("global_step", pos_.global_step);
  fit_loop.insert("batches_done_in_epoch", batches_done_in_epoch_);
  fit_loop.insert("epoch_end_phase", in_epoch_end_phase_);
  fit_loop.insert("elapsed_seconds",
                  elapsed_before_resume_ +
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - fit_start_time_).count());
  fit_loop.insert("cpu_rng_state", cpu_rng_state());
  auto loops = string_dict();
  loops.insert("fit_loop", fit_loop);
  ckpt.insert("loops", loops);

  if (!module_->hparams.values().empty()) ckpt.insert("hyper_parameters", options_dict(module_->hparams));
  if (data_ && !data_->hparams.values().empty())
    ckpt.insert("datamodule_hyper_parameters", options_dict(data_->hparams));

  if (!weights_only) {
    auto schedulers = any_list();
    for (auto& cfg : optimizer_configs_) {
      if (!cfg.scheduler) continue;
      auto s = string_dict();
      s.insert("last_epoch", cfg.scheduler->step_count());
      auto lrs = any_list();
      for (double lr : cfg.scheduler->last_lr()) lrs.push_back(lr);
      s.insert("_last_lr", lrs);
      auto state = any_list();
      for (double v : cfg.scheduler->state()) state.push_back(v);
      s.insert("fulgur_state", state);
      schedulers.push_back(s);
    }
    ckpt.insert("lr_schedulers", schedulers);
    auto callbacks = string_dict();
    for (const auto& slot : hooks_.slots()) {
      const std::string key = slot.callback->state_key();
      if (key.empty()) continue;
      c10::IValue state;
      slot.callback->state_dict(state);
      if (!state.isNone()) callbacks.insert(key, state);
    }
    ckpt.insert("callbacks", callbacks);
    c10::IValue precision_state;
    plugins_.precision->state_dict(precision_state);
    if (!precision_state.isNone() && !(precision_state.isGenericDict() && precision_state.toGenericDict().empty()))
      ckpt.insert("precision_state", precision_state);
  }
  c10::IValue result(ckpt);
  hooks_.call(Hook::save_checkpoint, [&](Callback& c) { c.on_save_checkpoint(*this, result); });
  return result;
}

void Trainer::Impl::save_checkpoint(const std::string& path, bool weights_only) {
  if (!module_) throw Error(ErrorKind::runtime, "save_checkpoint: no model is attached (call it during fit)");
  ProfileScope scope(plugins_.profiler.get(), "save_checkpoint");
  Strategy& strategy = *plugins_.strategy;
  // The strategy owns the model and optimizer state: it may return full tensors or its shards.
  c10::IValue model_state = strategy.module_state_dict(*module_);
  std::vector<c10::IValue> optimizer_states;
  if (!weights_only)
    for (auto* opt : optimizer_ptrs_) optimizer_states.push_back(strategy.optimizer_state_dict(*opt));
  c10::IValue metadata = dump_metadata(weights_only);
  strategy.save_checkpoint(CheckpointParts{&model_state, &optimizer_states, &metadata}, path);
}

std::string Trainer::Impl::resolve_checkpoint_path(const std::string& ckpt_path, Stage stage) {
  if (ckpt_path != "last" && ckpt_path != "best") {
    if (!plugins_.strategy->is_checkpoint(ckpt_path))
      throw Error(ErrorKind::checkpoint,
                  fmt::format("ckpt_path \"{}\" does not exist (or is not a checkpoint this strategy reads); pass an "
                              "existing checkpoint, \"last\" or \"best\"",
                              ckpt_path));
    return ckpt_path;
  }
  // Asked of the callbacks that provide checkpoints (model_checkpoint, or any plugin that declares
  // itself a provider); the first that knows one answers. For "last", a checkpoint written on a
  // signal (signal_connector.h) competes with it: the newer file wins, as in Lightning.
  const std::string interrupted =
      ckpt_path == "last" ? broadcast(existing_interrupt_checkpoint(config_, root_dir_), 0) : std::string();
  std::vector<std::string> looked;
  for (auto& slot : hooks_.slots()) {
    CheckpointProvider* provider = slot.callback->checkpoint_provider();
    if (!provider) continue;
    std::string path;
    try {
      path = ckpt_path == "best" ? provider->best_checkpoint_path(*this) : provider->last_checkpoint_path(*this);
      looked.push_back(fmt::format("{} ({})", slot.identity.name, provider->describe_location(*this)));
    } catch (...) {
      rethrow_attributed(slot.identity, ckpt_path == "best" ? "best_checkpoint_path" : "last_checkpoint_path", pos_);
    }
    if (!path.empty()) return ckpt_path == "last" ? broadcast(newer_checkpoint(path, interrupted), 0) : path;
  }
  if (!interrupted.empty()) return interrupted;
  const std::string where =
      looked.empty() ? std::string("no callback provides checkpoints (add a checkpoint callback under [[callbacks]])")
                     : fmt::format("asked {}", fmt::join(looked, "; "));
  if (ckpt_path == "last" && stage == Stage::fit) {
    // Lightning's behaviour: the first run of a config that always says "last" starts fresh.
    spdlog::warn("ckpt_path = \"last\": no last checkpoint exists yet ({}); training starts from scratch", where);
    return {};
  }
  throw Error(
      ErrorKind::checkpoint,
      fmt::format("ckpt_path = \"{}\": no {} checkpoint is known ({}); {}", ckpt_path, ckpt_path, where,
                  ckpt_path == "best"
                      ? "it needs a checkpoint callback with a monitor that has saved; pass a "
                        "checkpoint path instead"
                      : "let the checkpoint callback keep a last checkpoint (save_last) or pass a checkpoint path"));
}

Trainer::Impl::ReadCheckpoint Trainer::Impl::read_checkpoint(const std::string& path, bool with_optimizer_states) {
  ReadCheckpoint checkpoint;
  checkpoint.path = path;
  checkpoint.model_state = std::make_shared<c10::IValue>();
  checkpoint.metadata = std::make_shared<c10::IValue>();
  plugins_.strategy->load_checkpoint(
      path, CheckpointParts{checkpoint.model_state.get(), &checkpoint.optimizer_states, checkpoint.metadata.get()});
  as_dict(*checkpoint.metadata, "<top level>", path);
  if (!with_optimizer_states) checkpoint.optimizer_states.clear();
  return checkpoint;
}

void Trainer::Impl::restore_model(const ReadCheckpoint& checkpoint) {
  plugins_.strategy->load_module_state_dict(*module_, *checkpoint.model_state, /*strict=*/true, checkpoint.path);
}

void Trainer::Impl::restore_callbacks(const ReadCheckpoint& checkpoint) {
  const c10::IValue& metadata = *checkpoint.metadata;
  hooks_.call(Hook::load_checkpoint, [&](Callback& c) { c.on_load_checkpoint(*this, metadata); });
  auto states = get(metadata.toGenericDict(), "callbacks");
  if (!states || !states->isGenericDict()) return;
  const auto& dict = states->toGenericDict();
  for (const auto& slot : hooks_.slots()) {
    const std::string key = slot.callback->state_key();
    if (key.empty()) continue;
    auto it = dict.find(key);
    if (it == dict.end()) continue;
    try {
      slot.callback->load_state_dict(it->value());
    } catch (...) {
      rethrow_attributed(slot.identity, "load_state_dict", pos_);
    }
  }
}

void Trainer::Impl::restore_training_state(const ReadCheckpoint& checkpoint) {
  const std::string& path = checkpoint.path;
  const auto& ckpt = checkpoint.metadata->toGenericDict();
  const char* weights_only_hint =
      "it was saved with weights only; resume needs a full checkpoint (save_weights_only = false)";
  if (checkpoint.optimizer_states.empty() && !optimizer_ptrs_.empty())
    throw Error(ErrorKind::checkpoint,
                fmt::format("checkpoint {}: key 'optimizer_states' is missing; {}", path, weights_only_hint));
  if (checkpoint.optimizer_states.size() != optimizer_ptrs_.size())
    throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: {} optimizer states for {} optimizers", path,
                                                   checkpoint.optimizer_states.size(), optimizer_ptrs_.size()));
  for (size_t i = 0; i < optimizer_ptrs_.size(); ++i)
    plugins_.strategy->load_optimizer_state_dict(*optimizer_ptrs_[i], checkpoint.optimizer_states[i], path);

  auto schedulers = require_key(ckpt, "lr_schedulers", path, weights_only_hint).toList();
  size_t si = 0;
  for (auto& cfg : optimizer_configs_) {
    if (!cfg.scheduler) continue;
    if (si >= schedulers.size())
      throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: fewer lr scheduler states than schedulers", path));
    const auto& s = schedulers.get(si++).toGenericDict();
    std::vector<double> state;
    for (const c10::IValue& v : require_key(s, "fulgur_state", path, "").toList().vec()) state.push_back(v.toDouble());
    cfg.scheduler->load_state(state);
  }
  if (auto p = get(ckpt, "precision_state")) plugins_.precision->load_state_dict(*p);

  const auto& loops = as_dict(require_key(ckpt, "loops", path, "the loop position is missing"), "loops", path);
  const auto& fit_loop = as_dict(require_key(loops, "fit_loop", path, ""), "loops.fit_loop", path);
  pos_.epoch = require_key(fit_loop, "epoch", path, "").toInt();
  pos_.global_step = require_key(fit_loop, "global_step", path, "").toInt();
  resume_skip_batches_ = require_key(fit_loop, "batches_done_in_epoch", path, "").toInt();
  elapsed_before_resume_ = require_key(fit_loop, "elapsed_seconds", path, "").toDouble();
  set_cpu_rng_state(require_key(fit_loop, "cpu_rng_state", path, "").toTensor());
  if (require_key(fit_loop, "epoch_end_phase", path, "").toBool()) {
    // Saved during the epoch-end work: that epoch is complete. Finish what comes after the
    // callbacks (epoch schedulers; plateau ones need metrics that are not saved, as in Lightning).
    step_schedulers(SchedulerInterval::epoch, /*skip_monitored=*/true);
    ++pos_.epoch;
    resume_skip_batches_ = 0;
  }
  spdlog::info("Restored training state from {} (epoch {}, global step {}, {} batches into the epoch)", path,
               pos_.epoch, pos_.global_step, resume_skip_batches_);
}

}  // namespace fulgur
