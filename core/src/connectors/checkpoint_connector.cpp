// Checkpoints: Lightning 2.6's layout (a Lightning Trainer resumes from them) in an ordinary
// PyTorch zip archive (Python's torch.load(path, weights_only=True) opens it), Python-style dotted
// parameter names, optimizer states in Python's layout for the common optimizers, and everything
// exact resume needs (the loops' state, RNG, scheduler and precision state). What is written and
// read goes through the strategy in parts, so a sharded strategy can gather or write shards.
#include "checkpoint_connector.h"

#include <fulgur/error.h>
#include <fulgur/state_dict.h>

#include <ATen/core/ivalue.h>
#include <ATen/ops/full.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <iterator>
#include <set>
#include <vector>

#include "../ivalue_dict.h"
#include "../trainer_engine.h"

namespace fulgur {

namespace {

constexpr const char* kFulgurVersion = "0.1.0";

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

}  // namespace

c10::IValue CheckpointConnector::dump_metadata(bool weights_only) {
  TrainerEngine& t = trainer_;
  const RunPosition& position = t.fit_loop_.position();
  auto ckpt = string_dict();
  ckpt.insert("epoch", position.epoch);
  ckpt.insert("global_step", position.global_step);
  // The layout is Lightning 2.6's, and the claim is kept because it is true: Lightning's Trainer
  // resumes from this file (each loop writes Lightning's progress keys beside Fulgur's own, which
  // Lightning skips: lightning_progress.h), LightningModule.load_from_checkpoint reads its
  // state_dict and hyper_parameters, and a version at or above 2.0.0 keeps Lightning's
  // checkpoint migrations from rewriting it (tests/lightning_checkpoint_test.cpp runs both).
  ckpt.insert("pytorch-lightning_version", "2.6.0");
  ckpt.insert("fulgur_version", kFulgurVersion);
  // Each rank's data shard depends on the number of processes: a mid-epoch resume must match it.
  ckpt.insert("world_size", t.cluster().world_size);
  ckpt.insert("epoch_batches", t.fit_loop_.epoch_loop().num_batches());  // per rank; -1: unknown

  // Every loop's own state, under Lightning's names.
  auto loops = string_dict();
  loops.insert("fit_loop", t.fit_loop_.state_dict());
  loops.insert("validate_loop", t.validate_loop_.state_dict());
  loops.insert("test_loop", t.test_loop_.state_dict());
  loops.insert("predict_loop", t.predict_loop_.state_dict());
  ckpt.insert("loops", loops);

  if (!t.module_->hparams.values().empty()) ckpt.insert("hyper_parameters", options_dict(t.module_->hparams));
  if (t.data_ && !t.data_->hparams.values().empty())
    ckpt.insert("datamodule_hyper_parameters", options_dict(t.data_->hparams));

  if (!weights_only) {
    auto schedulers = any_list();
    for (auto& cfg : t.optimizer_configs_) {
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
    for (const auto& slot : t.hooks_.slots()) {
      const std::string key = slot.callback->state_key();
      if (key.empty()) continue;
      c10::IValue state;
      slot.callback->state_dict(state);
      if (!state.isNone()) callbacks.insert(key, state);
    }
    ckpt.insert("callbacks", callbacks);
    c10::IValue precision_state;
    t.plugins_.precision->state_dict(precision_state);
    if (!precision_state.isNone() && !(precision_state.isGenericDict() && precision_state.toGenericDict().empty()))
      ckpt.insert("precision_state", precision_state);
  }
  c10::IValue result(ckpt);
  t.hooks_.call(Hook::save_checkpoint, [&](Callback& c) { c.on_save_checkpoint(t, result); });
  return result;
}

void CheckpointConnector::save(const std::string& path, bool weights_only) {
  TrainerEngine& t = trainer_;
  if (!t.module_) throw Error(ErrorKind::runtime, "save_checkpoint: no model is attached (call it during fit)");
  ProfileScope scope(t.plugins_.profiler.get(), "save_checkpoint");
  Strategy& strategy = *t.plugins_.strategy;
  // The strategy owns the model and optimizer state: it may return full tensors or its shards.
  c10::IValue model_state = strategy.module_state_dict(*t.module_);
  std::vector<c10::IValue> optimizer_states;
  if (!weights_only) {
    t.sync_optimizer_host_state();
    for (auto* opt : t.optimizer_ptrs_) optimizer_states.push_back(strategy.optimizer_state_dict(*opt));
  }
  c10::IValue metadata = dump_metadata(weights_only);
  const SavedCheckpoint saved{path, t.global_step(), t.current_epoch(), weights_only};
  if (t.trainer_config_.async_checkpoint) {
    const bool single = strategy.cluster().world_size == 1;
    AsyncSaveStrategy* split = single ? nullptr : find_extension<AsyncSaveStrategy>(strategy);
    if (single || split) {
      save_in_background(path, std::move(model_state), std::move(optimizer_states), std::move(metadata), saved, split);
      return;
    }
    // The strategy's save may be a collective (a barrier, every rank writing its shards), which
    // must not run beside the training step's collectives on another thread; a strategy that
    // splits it (AsyncSaveStrategy) keeps the collectives on this thread.
    if (!warned_async_multiprocess_ && t.global_rank() == 0)
      spdlog::warn(
          "[trainer] async_checkpoint: strategy '{}' does not offer fulgur.strategy.async_save/1 (a save split "
          "into collective and background parts), so this run of {} processes saves its checkpoints synchronously",
          t.config_.trainer.get_string("strategy"), strategy.cluster().world_size);
    warned_async_multiprocess_ = true;
  }
  strategy.save_checkpoint(CheckpointParts{&model_state, &optimizer_states, &metadata}, path);
  // Complete on every rank once the strategy returns (its writes end in a barrier where several
  // ranks write): loggers that observe checkpoints may read or upload it now.
  t.logging_.after_save_checkpoint(saved);
}

void CheckpointConnector::save_in_background(const std::string& path, c10::IValue model_state,
                                             std::vector<c10::IValue> optimizer_states, c10::IValue metadata,
                                             const SavedCheckpoint& saved, AsyncSaveStrategy* split) {
  // One save in flight: the previous one completes (or fails the run) before this one starts.
  wait_for_pending_save();
  // Training goes on and changes the weights and optimizer state in place: the background thread
  // writes a host copy taken now (the parts may be views of the live tensors, or on a device).
  struct HostParts {
    c10::IValue model_state, metadata;
    std::vector<c10::IValue> optimizer_states;
  };
  auto host = std::make_shared<HostParts>();
  host->model_state = copy_to_host(model_state);
  for (const c10::IValue& state : optimizer_states) host->optimizer_states.push_back(copy_to_host(state));
  host->metadata = copy_to_host(metadata);
  model_state = c10::IValue();
  optimizer_states.clear();
  Strategy& strategy = *trainer_.plugins_.strategy;
  const CheckpointParts parts{&host->model_state, &host->optimizer_states, &host->metadata};
  std::function<void()> write;
  if (split) {
    // The collective part here, on every rank; the write (this rank's bytes) in the background.
    // The write may keep pointers into `host`, which lives as long as it does.
    write = [host, rank_write = split->prepare_save(parts, path)] {
      if (rank_write) rank_write();
    };
  } else {
    write = [&strategy, host, parts, path] { strategy.save_checkpoint(parts, path); };
  }
  async_writer_.start(path, std::move(write), trainer_.global_rank());
  pending_ = saved;
  split_ = split;
}

std::vector<int64_t> CheckpointConnector::failed_ranks(bool failed) {
  Strategy& strategy = *trainer_.plugins_.strategy;
  const at::Tensor mine =
      at::full({1}, failed ? 1 : 0, at::TensorOptions().dtype(at::kLong).device(strategy.root_device()));
  std::vector<int64_t> out;
  const std::vector<at::Tensor> all = strategy.all_gather(mine);
  for (size_t rank = 0; rank < all.size(); ++rank)
    if (all[rank].item<int64_t>() != 0) out.push_back(static_cast<int64_t>(rank));
  return out;
}

void CheckpointConnector::wait_for_pending_save(bool collective) {
  if (!async_writer_.in_flight()) return;
  const std::string path = *async_writer_.in_flight();
  std::optional<SavedCheckpoint> saved = std::exchange(pending_, std::nullopt);
  // A failed save drops the deferred work: what it was to replace (a top-k file) stays.
  std::vector<std::function<void()>> actions = std::exchange(after_save_, {});
  if (AsyncSaveStrategy* split = std::exchange(split_, nullptr)) {
    const std::string failure = async_writer_.wait_for_failure();
    // The run already failed on this rank: the others may never reach the agreement below.
    if (!collective) {
      if (!failure.empty())
        throw Error(ErrorKind::checkpoint,
                    fmt::format("the checkpoint '{}' saved in the background ([trainer] async_checkpoint) failed on "
                                "rank {}: {}",
                                path, trainer_.global_rank(), failure));
      return;
    }
    // Every rank learns whether every rank's write succeeded, then the strategy completes the
    // checkpoint (or cleans up) on all of them: the checkpoint exists only when every part does.
    const std::vector<int64_t> failed = failed_ranks(!failure.empty());
    // Every rank says why it failed (the failing rank's log may be cut short when the launcher
    // stops it): the failing ranks send their reason, before finish_save's own collectives.
    std::vector<std::string> reasons;
    for (const int64_t rank : failed)
      reasons.push_back(fmt::format("rank {}: {}", rank, trainer_.plugins_.strategy->broadcast_string(failure, rank)));
    std::string finish_failure;
    try {
      split->finish_save(path, failed.empty());
    } catch (const std::exception& e) {
      if (failed.empty()) throw;
      finish_failure = e.what();
    }
    if (!failed.empty()) {
      std::string message =
          fmt::format("the checkpoint '{}' saved in the background ([trainer] async_checkpoint) failed on {}", path,
                      fmt::join(reasons, "; "));
      if (!finish_failure.empty()) message += fmt::format("; cleaning it up failed too: {}", finish_failure);
      throw Error(ErrorKind::checkpoint, message);
    }
  } else {
    async_writer_.wait();
  }
  if (saved) trainer_.logging_.after_save_checkpoint(*saved);
  for (auto& action : actions) action();
}

void CheckpointConnector::after_pending_save(std::function<void()> action) {
  if (!action) return;
  if (async_writer_.in_flight())
    after_save_.push_back(std::move(action));
  else
    action();
}

std::string CheckpointConnector::resolve(const std::string& ckpt_path, Stage stage) {
  TrainerEngine& t = trainer_;
  if (ckpt_path != "last" && ckpt_path != "best") {
    if (!t.plugins_.strategy->is_checkpoint(ckpt_path))
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
      ckpt_path == "last"
          ? t.broadcast(existing_interrupt_checkpoint(t.config_, t.trainer_config_.checkpoint_root()), 0)
          : std::string();
  std::vector<std::string> looked;
  for (auto& slot : t.hooks_.slots()) {
    CheckpointProvider* provider = slot.callback->checkpoint_provider();
    if (!provider) continue;
    std::string path;
    try {
      path = ckpt_path == "best" ? provider->best_checkpoint_path(t) : provider->last_checkpoint_path(t);
      looked.push_back(fmt::format("{} ({})", slot.identity.name, provider->describe_location(t)));
    } catch (...) {
      rethrow_attributed(slot.identity, ckpt_path == "best" ? "best_checkpoint_path" : "last_checkpoint_path",
                         t.fit_loop_.position());
    }
    if (!path.empty()) return ckpt_path == "last" ? t.broadcast(newer_checkpoint(path, interrupted), 0) : path;
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

CheckpointConnector::ReadCheckpoint CheckpointConnector::read(const std::string& path, bool with_optimizer_states) {
  TrainerEngine& t = trainer_;
  ReadCheckpoint checkpoint;
  checkpoint.path = path;
  checkpoint.model_state = std::make_shared<c10::IValue>();
  checkpoint.metadata = std::make_shared<c10::IValue>();
  t.plugins_.strategy->load_checkpoint(
      path, CheckpointParts{checkpoint.model_state.get(), &checkpoint.optimizer_states, checkpoint.metadata.get()});
  as_dict(*checkpoint.metadata, "<top level>", path);
  if (!with_optimizer_states) checkpoint.optimizer_states.clear();
  return checkpoint;
}

void CheckpointConnector::restore_model(const ReadCheckpoint& checkpoint, Stage stage) {
  TrainerEngine& t = trainer_;
  // A sharded strategy's own layout: its keys are its business (learned scales need a dict).
  if (checkpoint.model_state->isGenericDict()) {
    TensorMap scales;
    for (const auto& entry : checkpoint.model_state->toGenericDict())
      if (entry.key().isString() && entry.value().isTensor()) {
        const std::string& key = entry.key().toStringRef();
        if (key.ends_with("weight_scale") || key.ends_with("input_scale"))
          scales.emplace(key, entry.value().toTensor());
      }
    prepare_learned_scales(scales, checkpoint.path, stage == Stage::fit);
  }
  // [trainer] strict_loading (Lightning's LightningModule.strict_loading): false loads the keys
  // that match and warns once about the others; shapes must match either way (as in torch).
  const bool strict = t.trainer_config_.strict_loading;
  if (!strict) warn_unmatched_keys(*checkpoint.model_state, checkpoint.path);
  try {
    t.plugins_.strategy->load_module_state_dict(*t.module_, *checkpoint.model_state, strict, checkpoint.path);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (strict && e.kind() == ErrorKind::checkpoint &&
        (what.find("missing keys") != std::string::npos || what.find("unexpected keys") != std::string::npos))
      throw Error(e.kind(), what +
                                "\n  to load the keys that match and leave the others as they are, set "
                                "[trainer] strict_loading = false");
    throw;
  }
}

void CheckpointConnector::warn_unmatched_keys(const c10::IValue& model_state, const std::string& path) {
  TrainerEngine& t = trainer_;
  // A strategy that reads shards may hand over another layout: then only it knows the keys.
  if (!model_state.isGenericDict()) return;
  std::set<std::string> model_keys;
  for (const auto& item : t.module_->named_parameters(/*recurse=*/true)) model_keys.insert(item.key());
  for (const auto& item : t.module_->named_buffers(/*recurse=*/true)) model_keys.insert(item.key());
  std::vector<std::string> missing, unexpected;
  std::set<std::string> saved_keys;
  for (const auto& entry : model_state.toGenericDict())
    if (entry.key().isString()) saved_keys.insert(entry.key().toStringRef());
  std::set_difference(model_keys.begin(), model_keys.end(), saved_keys.begin(), saved_keys.end(),
                      std::back_inserter(missing));
  std::set_difference(saved_keys.begin(), saved_keys.end(), model_keys.begin(), model_keys.end(),
                      std::back_inserter(unexpected));
  if (missing.empty() && unexpected.empty()) return;
  std::string message = fmt::format("checkpoint {}: strict_loading = false, so the model loads the {} keys that match",
                                    path, saved_keys.size() - unexpected.size());
  if (!missing.empty())
    message += fmt::format("; missing keys (left as the model initialized them): {}", fmt::join(missing, ", "));
  if (!unexpected.empty()) message += fmt::format("; unexpected keys (ignored): {}", fmt::join(unexpected, ", "));
  if (t.global_rank() == 0) spdlog::warn("{}", message);
}

void CheckpointConnector::restore_callbacks(const ReadCheckpoint& checkpoint) {
  TrainerEngine& t = trainer_;
  const c10::IValue& metadata = *checkpoint.metadata;
  t.hooks_.call(Hook::load_checkpoint, [&](Callback& c) { c.on_load_checkpoint(t, metadata); });
  auto states = get(metadata.toGenericDict(), "callbacks");
  if (!states || !states->isGenericDict()) return;
  const auto& dict = states->toGenericDict();
  for (const auto& slot : t.hooks_.slots()) {
    const std::string key = slot.callback->state_key();
    if (key.empty()) continue;
    auto it = dict.find(key);
    if (it == dict.end()) continue;
    try {
      slot.callback->load_state_dict(it->value());
    } catch (...) {
      rethrow_attributed(slot.identity, "load_state_dict", t.fit_loop_.position());
    }
  }
}

void CheckpointConnector::restore_training_state(const ReadCheckpoint& checkpoint) {
  TrainerEngine& t = trainer_;
  const std::string& path = checkpoint.path;
  const auto& ckpt = checkpoint.metadata->toGenericDict();
  const char* weights_only_hint =
      "it was saved with weights only; resume needs a full checkpoint (save_weights_only = false)";
  if (checkpoint.optimizer_states.empty() && !t.optimizer_ptrs_.empty())
    throw Error(ErrorKind::checkpoint,
                fmt::format("checkpoint {}: key 'optimizer_states' is missing; {}", path, weights_only_hint));
  if (checkpoint.optimizer_states.size() != t.optimizer_ptrs_.size())
    throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: {} optimizer states for {} optimizers", path,
                                                   checkpoint.optimizer_states.size(), t.optimizer_ptrs_.size()));
  for (size_t i = 0; i < t.optimizer_ptrs_.size(); ++i)
    t.plugins_.strategy->load_optimizer_state_dict(*t.optimizer_ptrs_[i], checkpoint.optimizer_states[i], path);

  auto schedulers = require_key(ckpt, "lr_schedulers", path, weights_only_hint).toList();
  size_t si = 0;
  for (auto& cfg : t.optimizer_configs_) {
    if (!cfg.scheduler) continue;
    if (si >= schedulers.size())
      throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: fewer lr scheduler states than schedulers", path));
    const auto& s = schedulers.get(si++).toGenericDict();
    std::vector<double> state;
    for (const c10::IValue& v : require_key(s, "fulgur_state", path, "").toList().vec()) state.push_back(v.toDouble());
    cfg.scheduler->load_state(state);
  }
  if (auto p = get(ckpt, "precision_state")) t.plugins_.precision->load_state_dict(*p);

  // Each loop restores its own state; the evaluation loops' entries are absent in checkpoints
  // written before the loops kept one.
  const auto& loops = as_dict(require_key(ckpt, "loops", path, "the loop position is missing"), "loops", path);
  t.fit_loop_.load_state_dict(require_key(loops, "fit_loop", path, ""), path);
  if (auto v = get(loops, "validate_loop")) t.validate_loop_.load_state_dict(*v, path);
  if (auto v = get(loops, "test_loop")) t.test_loop_.load_state_dict(*v, path);
  if (auto v = get(loops, "predict_loop")) t.predict_loop_.load_state_dict(*v, path);
  const RunPosition& position = t.fit_loop_.position();
  // Model, optimizer and loop state are the same for every rank count (replicated, or full-state
  // or resharded checkpoints of a sharded strategy), but the samples each rank sees within an epoch
  // are not: a mid-epoch resume under another world size deals out the rest of the epoch's global
  // order again (the training epoch loop), which needs the checkpoint to record where it stood.
  const int64_t skip = t.fit_loop_.epoch_loop().batches_to_skip();
  if (auto saved = get(ckpt, "world_size"); saved && saved->isInt() && saved->toInt() != t.cluster().world_size) {
    if (skip > 0 && t.fit_loop_.epoch_loop().resume_has_sample_position()) {
      spdlog::info("Restored training state from {} (epoch {}, global step {}, written by {} processes)", path,
                   position.epoch, position.global_step, saved->toInt());
      return;
    }
    // After the epoch's last batch (validation or epoch-end hooks still to run) nothing is skipped.
    const auto batches = get(ckpt, "epoch_batches");
    const bool epoch_trained = batches && batches->isInt() && batches->toInt() > 0 && skip >= batches->toInt();
    if (skip > 0 && !epoch_trained)
      throw Error(ErrorKind::checkpoint,
                  fmt::format("checkpoint {} was written by {} processes and this run has {}: it stopped {} batches "
                              "into epoch {} and does not record where the epoch stood in global samples (written "
                              "by an older Fulgur, or its train loader streams: an iterable dataset keeps its "
                              "position per rank), so resuming there would repeat some samples and skip others. "
                              "Resume with {} processes, or from a checkpoint saved at an epoch end",
                              path, saved->toInt(), t.cluster().world_size, skip, position.epoch, saved->toInt()));
    spdlog::warn("checkpoint {} was written by {} processes, this run has {}: resuming {} of epoch {}", path,
                 saved->toInt(), t.cluster().world_size, skip > 0 ? "after the last training batch" : "at the start",
                 position.epoch);
  }
  spdlog::info("Restored training state from {} (epoch {}, global step {}, {} batches into the epoch)", path,
               position.epoch, position.global_step, t.fit_loop_.epoch_loop().batches_to_skip());
}

}  // namespace fulgur
