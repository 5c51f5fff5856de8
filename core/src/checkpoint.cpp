// Checkpoints: Lightning's top-level keys in an ordinary PyTorch zip archive (Python's
// torch.load(path, weights_only=True) opens it), Python-style dotted parameter names, optimizer
// states in Python's layout for the common optimizers, and everything exact resume needs
// (loop position, RNG, scheduler and precision state).
#include <fulgur/error.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <sstream>

#include "trainer_impl.h"

namespace fulgur {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFulgurVersion = "0.1.0";

c10::impl::GenericDict string_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }
c10::impl::GenericDict int_dict() { return c10::impl::GenericDict(c10::IntType::get(), c10::AnyType::get()); }
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

int64_t scalar_int(const c10::IValue& v) {
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) return static_cast<int64_t>(v.toDouble());
  if (v.isTensor()) return v.toTensor().item<int64_t>();
  throw Error(ErrorKind::checkpoint, "expected an integer in the checkpoint");
}

// ---- optimizer state in Python's layout ---------------------------------------------------------

c10::impl::GenericDict optimizer_state(torch::optim::Optimizer& optimizer) {
  auto out = string_dict();
  auto state = int_dict();
  auto groups = any_list();
  int64_t index = 0;
  auto& param_state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    auto g = string_dict();
    auto params = any_list();
    const auto& opts = group.options();
    g.insert("lr", opts.get_lr());
    if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&opts)) {
      g.insert("betas", c10::ivalue::Tuple::create({std::get<0>(a->betas()), std::get<1>(a->betas())}));
      g.insert("eps", a->eps());
      g.insert("weight_decay", a->weight_decay());
      g.insert("amsgrad", a->amsgrad());
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&opts)) {
      g.insert("betas", c10::ivalue::Tuple::create({std::get<0>(w->betas()), std::get<1>(w->betas())}));
      g.insert("eps", w->eps());
      g.insert("weight_decay", w->weight_decay());
      g.insert("amsgrad", w->amsgrad());
    } else if (auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&opts)) {
      g.insert("momentum", s->momentum());
      g.insert("dampening", s->dampening());
      g.insert("weight_decay", s->weight_decay());
      g.insert("nesterov", s->nesterov());
    }
    for (auto& p : group.params()) {
      params.push_back(index);
      auto it = param_state.find(p.unsafeGetTensorImpl());
      if (it != param_state.end()) {
        auto s = string_dict();
        if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
          s.insert("step", at::scalar_tensor(static_cast<double>(adam->step()), at::kFloat));
          s.insert("exp_avg", adam->exp_avg());
          s.insert("exp_avg_sq", adam->exp_avg_sq());
          if (adam->max_exp_avg_sq().defined()) s.insert("max_exp_avg_sq", adam->max_exp_avg_sq());
        } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
          s.insert("step", at::scalar_tensor(static_cast<double>(adamw->step()), at::kFloat));
          s.insert("exp_avg", adamw->exp_avg());
          s.insert("exp_avg_sq", adamw->exp_avg_sq());
          if (adamw->max_exp_avg_sq().defined()) s.insert("max_exp_avg_sq", adamw->max_exp_avg_sq());
        } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
          if (sgd->momentum_buffer().defined()) s.insert("momentum_buffer", sgd->momentum_buffer());
        }
        state.insert(index, s);
      }
      ++index;
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  out.insert("state", state);
  out.insert("param_groups", groups);
  const bool known = dynamic_cast<torch::optim::Adam*>(&optimizer) || dynamic_cast<torch::optim::AdamW*>(&optimizer) ||
                     dynamic_cast<torch::optim::SGD*>(&optimizer);
  if (!known) {
    // Other optimizers: LibTorch's own archive as bytes, so resume still restores them exactly.
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    const std::string data = bytes.str();
    at::Tensor blob = at::empty({static_cast<int64_t>(data.size())}, at::kByte);
    std::memcpy(blob.data_ptr(), data.data(), data.size());
    out.insert("fulgur_archive", blob);
  }
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, const c10::IValue& value, const std::string& path) {
  const auto& dict = as_dict(value, "optimizer_states[i]", path);
  if (auto blob = get(dict, "fulgur_archive")) {
    at::Tensor t = blob->toTensor().contiguous();
    std::istringstream bytes(std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel())));
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    optimizer.load(archive);
  }
  auto groups = require_key(dict, "param_groups", path, "the optimizer state is incomplete").toList();
  if (groups.size() != optimizer.param_groups().size())
    throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: optimizer has {} param groups, checkpoint has {}",
                                                   path, optimizer.param_groups().size(), groups.size()));
  auto state = as_dict(require_key(dict, "state", path, "the optimizer state is incomplete"), "state", path);
  int64_t index = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    auto& group = optimizer.param_groups()[gi];
    const auto& saved = as_dict(groups.get(gi), "param_groups[i]", path);
    // LibTorch's Optimizer::load does not restore group options (lr after a scheduler); we do.
    group.options().set_lr(require_key(saved, "lr", path, "").toDouble());
    const size_t saved_params = require_key(saved, "params", path, "").toList().size();
    if (saved_params != group.params().size())
      throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: optimizer param group {} has {} parameters, "
                                                     "checkpoint has {}; it belongs to another model",
                                                     path, gi, group.params().size(), saved_params));
    for (auto& p : group.params()) {
      auto it = state.find(index);
      ++index;
      if (it == state.end()) continue;
      const auto& s = it->value().toGenericDict();
      void* key = p.unsafeGetTensorImpl();
      auto clone = [&](const char* k) { return require_key(s, k, path, "").toTensor().clone().to(p.device()); };
      if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
        auto ps = std::make_unique<torch::optim::AdamParamState>();
        ps->step(scalar_int(require_key(s, "step", path, "")));
        ps->exp_avg(clone("exp_avg"));
        ps->exp_avg_sq(clone("exp_avg_sq"));
        if (get(s, "max_exp_avg_sq")) ps->max_exp_avg_sq(clone("max_exp_avg_sq"));
        optimizer.state()[key] = std::move(ps);
      } else if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
        auto ps = std::make_unique<torch::optim::AdamWParamState>();
        ps->step(scalar_int(require_key(s, "step", path, "")));
        ps->exp_avg(clone("exp_avg"));
        ps->exp_avg_sq(clone("exp_avg_sq"));
        if (get(s, "max_exp_avg_sq")) ps->max_exp_avg_sq(clone("max_exp_avg_sq"));
        optimizer.state()[key] = std::move(ps);
      } else if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
        auto ps = std::make_unique<torch::optim::SGDParamState>();
        if (get(s, "momentum_buffer")) ps->momentum_buffer(clone("momentum_buffer"));
        optimizer.state()[key] = std::move(ps);
      }
    }
  }
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

c10::IValue Trainer::Impl::dump_checkpoint(bool weights_only) {
  auto ckpt = string_dict();
  ckpt.insert("epoch", epoch_);
  ckpt.insert("global_step", global_step_);
  ckpt.insert("pytorch-lightning_version", "2.6.0");  // the layout this file follows
  ckpt.insert("fulgur_version", kFulgurVersion);

  auto state_dict = c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : module_->named_parameters(/*recurse=*/true))
    state_dict.insert(item.key(), item.value().detach());
  for (const auto& item : module_->named_buffers(/*recurse=*/true))
    state_dict.insert(item.key(), item.value().detach());
  ckpt.insert("state_dict", state_dict);

  auto fit_loop = string_dict();
  fit_loop.insert("epoch", epoch_);
  fit_loop.insert("global_step", global_step_);
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
    auto optimizer_states = any_list();
    for (auto* opt : optimizer_ptrs_) optimizer_states.push_back(optimizer_state(*opt));
    ckpt.insert("optimizer_states", optimizer_states);
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
    for (const auto& slot : callbacks_) {
      const std::string key = slot.callback->state_key();
      if (key.empty()) continue;
      c10::IValue state;
      slot.callback->state_dict(state);
      if (!state.isNone()) callbacks.insert(key, state);
    }
    ckpt.insert("callbacks", callbacks);
    c10::IValue precision_state;
    precision_->state_dict(precision_state);
    if (!precision_state.isNone() && !(precision_state.isGenericDict() && precision_state.toGenericDict().empty()))
      ckpt.insert("precision_state", precision_state);
  }
  c10::IValue result(ckpt);
  call(Hook::save_checkpoint, [&](Callback& c) { c.on_save_checkpoint(*this, result); });
  return result;
}

void Trainer::Impl::save_checkpoint(const std::string& path, bool weights_only) {
  if (!module_) throw Error(ErrorKind::runtime, "save_checkpoint: no model is attached (call it during fit)");
  ProfileScope scope(profiler_.get(), "save_checkpoint");
  c10::IValue checkpoint = dump_checkpoint(weights_only);
  std::error_code ec;
  if (fs::path parent = fs::path(path).parent_path(); !parent.empty()) fs::create_directories(parent, ec);
  strategy_->save_checkpoint(checkpoint, path);
}

std::string Trainer::Impl::resolve_checkpoint_path(const std::string& ckpt_path) {
  if (ckpt_path != "last" && ckpt_path != "best") {
    if (!fs::exists(ckpt_path))
      throw Error(ErrorKind::checkpoint,
                  fmt::format("ckpt_path \"{}\" does not exist; pass an existing checkpoint file, \"last\" or \"best\"",
                              ckpt_path));
    return ckpt_path;
  }
  // The model_checkpoint callback knows its best/last files for checkpoints of this process.
  for (const auto& slot : callbacks_) {
    if (slot.name != "model_checkpoint") continue;
    c10::IValue state;
    slot.callback->state_dict(state);
    if (!state.isGenericDict()) continue;
    auto key = ckpt_path == "best" ? "best_model_path" : "last_model_path";
    if (auto v = get(state.toGenericDict(), key);
        v && v->isString() && !v->toStringRef().empty() && fs::exists(v->toStringRef()))
      return v->toStringRef();
  }
  if (ckpt_path == "best")
    throw Error(ErrorKind::checkpoint,
                "ckpt_path=\"best\": no best checkpoint is known; it needs a model_checkpoint callback with a monitor "
                "that has saved during this run. Pass a checkpoint path instead");
  // A new process: the newest last*.ckpt under default_root_dir (what save_last writes).
  fs::path newest;
  fs::file_time_type newest_time{};
  std::error_code ec;
  if (fs::exists(root_dir_, ec)) {
    for (auto it = fs::recursive_directory_iterator(root_dir_, fs::directory_options::skip_permission_denied, ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) break;
      const std::string name = it->path().filename().string();
      if (it->is_regular_file() && name.starts_with("last") && name.ends_with(".ckpt")) {
        auto t = fs::last_write_time(it->path(), ec);
        if (newest.empty() || t > newest_time) {
          newest = it->path();
          newest_time = t;
        }
      }
    }
  }
  if (newest.empty())
    throw Error(ErrorKind::checkpoint,
                fmt::format("ckpt_path=\"last\": no last checkpoint was saved under {} (looked for last*.ckpt); "
                            "enable save_last in model_checkpoint or pass a checkpoint path",
                            root_dir_));
  return newest.string();
}

c10::IValue Trainer::Impl::read_checkpoint(const std::string& path) {
  c10::IValue checkpoint;
  strategy_->load_checkpoint(path, checkpoint);
  as_dict(checkpoint, "<top level>", path);
  return checkpoint;
}

void Trainer::Impl::restore_model(const c10::IValue& checkpoint, const std::string& path) {
  const auto& ckpt = checkpoint.toGenericDict();
  const auto& saved = as_dict(require_key(ckpt, "state_dict", path, "it holds no model weights"), "state_dict", path);
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : module_->named_parameters(true)) targets[item.key()] = item.value();
  for (const auto& item : module_->named_buffers(true)) targets[item.key()] = item.value();
  std::vector<std::string> missing, unexpected, mismatched;
  for (const auto& [name, t] : targets)
    if (saved.find(name) == saved.end()) missing.push_back(name);
  for (const auto& entry : saved) {
    const std::string name = entry.key().toStringRef();
    auto it = targets.find(name);
    if (it == targets.end()) {
      unexpected.push_back(name);
      continue;
    }
    const at::Tensor t = entry.value().toTensor();
    if (t.sizes() != it->second.sizes())
      mismatched.push_back(
          fmt::format("{} (checkpoint {}, model {})", name, c10::str(t.sizes()), c10::str(it->second.sizes())));
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::sort(unexpected.begin(), unexpected.end());
    std::string message = fmt::format("checkpoint {} does not match this model ({}):", path, module_->name());
    if (!missing.empty()) message += fmt::format("\n  missing keys: {}", fmt::join(missing, ", "));
    if (!unexpected.empty()) message += fmt::format("\n  unexpected keys: {}", fmt::join(unexpected, ", "));
    if (!mismatched.empty()) message += fmt::format("\n  shape mismatches: {}", fmt::join(mismatched, ", "));
    message += "\n  it was probably written for another model or another configuration of it";
    throw Error(ErrorKind::checkpoint, message);
  }
  torch::NoGradGuard no_grad;
  for (const auto& entry : saved) targets[entry.key().toStringRef()].copy_(entry.value().toTensor());
}

void Trainer::Impl::restore_callbacks(const c10::IValue& checkpoint) {
  call(Hook::load_checkpoint, [&](Callback& c) { c.on_load_checkpoint(*this, checkpoint); });
  auto states = get(checkpoint.toGenericDict(), "callbacks");
  if (!states || !states->isGenericDict()) return;
  const auto& dict = states->toGenericDict();
  for (const auto& slot : callbacks_) {
    const std::string key = slot.callback->state_key();
    if (key.empty()) continue;
    auto it = dict.find(key);
    if (it != dict.end()) slot.callback->load_state_dict(it->value());
  }
}

void Trainer::Impl::restore_training_state(const c10::IValue& checkpoint, const std::string& path) {
  const auto& ckpt = checkpoint.toGenericDict();
  const char* weights_only_hint =
      "it was saved with weights only; resume needs a full checkpoint (save_weights_only = false)";
  auto optimizer_states = require_key(ckpt, "optimizer_states", path, weights_only_hint).toList();
  if (optimizer_states.size() != optimizer_ptrs_.size())
    throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: {} optimizer states for {} optimizers", path,
                                                   optimizer_states.size(), optimizer_ptrs_.size()));
  for (size_t i = 0; i < optimizer_ptrs_.size(); ++i)
    load_optimizer_state(*optimizer_ptrs_[i], optimizer_states.get(i), path);

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
  if (auto p = get(ckpt, "precision_state")) precision_->load_state_dict(*p);

  const auto& loops = as_dict(require_key(ckpt, "loops", path, "the loop position is missing"), "loops", path);
  const auto& fit_loop = as_dict(require_key(loops, "fit_loop", path, ""), "loops.fit_loop", path);
  epoch_ = require_key(fit_loop, "epoch", path, "").toInt();
  global_step_ = require_key(fit_loop, "global_step", path, "").toInt();
  resume_skip_batches_ = require_key(fit_loop, "batches_done_in_epoch", path, "").toInt();
  elapsed_before_resume_ = require_key(fit_loop, "elapsed_seconds", path, "").toDouble();
  set_cpu_rng_state(require_key(fit_loop, "cpu_rng_state", path, "").toTensor());
  if (require_key(fit_loop, "epoch_end_phase", path, "").toBool()) {
    // Saved during the epoch-end work: that epoch is complete. Finish what comes after the
    // callbacks (epoch schedulers; plateau ones need metrics that are not saved, as in Lightning).
    step_schedulers(SchedulerInterval::epoch, /*skip_monitored=*/true);
    ++epoch_;
    resume_skip_batches_ = 0;
  }
  spdlog::info("Restored training state from {} (epoch {}, global step {}, {} batches into the epoch)", path, epoch_,
               global_step_, resume_skip_batches_);
}

}  // namespace fulgur
