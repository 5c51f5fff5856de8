// Default model/optimizer state handling (the Strategy base class uses these): Python-layout
// state dicts, strict loading with a report of every mismatched key, and the Lightning-layout
// join/split of checkpoint parts.
#include <fulgur/detail/ivalue_dict.h>
#include <fulgur/error.h>
#include <fulgur/state_dict.h>
#include <fulgur/strategy.h>

#include <ATen/core/ivalue.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>

namespace fulgur {

namespace {

using detail::any_list;
using detail::as_dict;
using detail::get;
using detail::int_dict;
using detail::require_key;
using detail::string_dict;

int64_t scalar_int(const c10::IValue& v) {
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) return static_cast<int64_t>(v.toDouble());
  if (v.isTensor()) return v.toTensor().item<int64_t>();
  throw Error(ErrorKind::checkpoint, "expected an integer in the checkpoint");
}

// ---- optimizer state in Python's layout ---------------------------------------------------------

namespace {

// LibTorch's archives cannot hold an undefined tensor, and LBFGS leaves some of its state tensors
// undefined (`al` beyond the history so far, the direction before a first iteration): its own save()
// then fails with "Cannot access storage of UndefinedTensorImpl". Around the save they stand in as
// empty tensors, which the load turns back into undefined ones.
std::vector<at::Tensor*> lbfgs_state_tensors(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor*> tensors;
  if (!dynamic_cast<torch::optim::LBFGS*>(&optimizer)) return tensors;
  for (auto& [key, state] : optimizer.state())
    if (auto* lbfgs = dynamic_cast<torch::optim::LBFGSParamState*>(state.get())) {
      // The TORCH_ARG accessors return references to the members.
      tensors.push_back(&const_cast<at::Tensor&>(lbfgs->d()));
      tensors.push_back(&const_cast<at::Tensor&>(lbfgs->H_diag()));
      tensors.push_back(&const_cast<at::Tensor&>(lbfgs->prev_flat_grad()));
      // `al` is sized to the history and filled only as far as the history goes.
      if (lbfgs->al())
        for (at::Tensor& t : const_cast<std::optional<std::vector<at::Tensor>>&>(lbfgs->al()).value())
          tensors.push_back(&t);
    }
  return tensors;
}

}  // namespace

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
    std::vector<at::Tensor*> stand_ins;
    for (at::Tensor* t : lbfgs_state_tensors(optimizer))
      if (!t->defined()) {
        *t = at::empty({0});
        stand_ins.push_back(t);
      }
    optimizer.save(archive);
    for (at::Tensor* t : stand_ins) *t = at::Tensor();
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
    for (at::Tensor* t : lbfgs_state_tensors(optimizer))
      if (t->defined() && t->dim() == 1 && t->numel() == 0) *t = at::Tensor();
  }
  auto groups = require_key(dict, "param_groups", path, "the optimizer state is incomplete").toList();
  if (groups.size() != optimizer.param_groups().size())
    throw Error(ErrorKind::checkpoint, fmt::format("checkpoint {}: optimizer has {} param groups, checkpoint has {}",
                                                   path, optimizer.param_groups().size(), groups.size()));
  auto state = as_dict(require_key(dict, "state", path, "the optimizer state is incomplete"), "state", path);
  // torch.optim keys per-parameter state by the parameter's index. Anything else (FSDP's optimizer
  // state dicts key it by parameter name) would match nothing and lose the state silently.
  for (const auto& entry : state)
    if (!entry.key().isInt())
      throw Error(ErrorKind::checkpoint,
                  fmt::format("checkpoint {}: the optimizer state is keyed by {} '{}', not by parameter index as "
                              "torch.optim's state_dict() is; convert it (e.g. FSDP's "
                              "get_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict="
                              "False)) keys by name)",
                              path, entry.key().tagKind(), entry.key().isString() ? entry.key().toStringRef() : ""));
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
      void* key = p.unsafeGetTensorImpl();
      // No saved state: the parameter had not been stepped then. State it gained since (an LR
      // sweep's or a batch-size trial's steps) must go, as torch's load_state_dict replaces all.
      if (it == state.end()) {
        optimizer.state().erase(key);
        continue;
      }
      const auto& s = it->value().toGenericDict();
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

}  // namespace

c10::IValue module_state_dict(torch::nn::Module& module) {
  auto state = c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : module.named_parameters(/*recurse=*/true)) state.insert(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) state.insert(item.key(), item.value().detach());
  return state;
}

void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                            const std::string& origin) {
  const auto& saved = as_dict(state, "state_dict", origin);
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : module.named_parameters(true)) targets[item.key()] = item.value();
  for (const auto& item : module.named_buffers(true)) targets[item.key()] = item.value();
  std::vector<std::string> missing, unexpected, mismatched;
  for (const auto& [name, t] : targets)
    if (saved.find(name) == saved.end()) missing.push_back(name);
  for (const auto& entry : saved) {
    if (!entry.key().isString() || !entry.value().isTensor())
      throw Error(
          ErrorKind::checkpoint,
          fmt::format("checkpoint {}: the model state holds a non-tensor entry; the file is not a state dict", origin));
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
  if (!strict) {
    missing.clear();
    unexpected.clear();
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::sort(unexpected.begin(), unexpected.end());
    std::string message = fmt::format("checkpoint {} does not match this model ({}):", origin, module.name());
    if (!missing.empty()) message += fmt::format("\n  missing keys: {}", fmt::join(missing, ", "));
    if (!unexpected.empty()) message += fmt::format("\n  unexpected keys: {}", fmt::join(unexpected, ", "));
    if (!mismatched.empty()) message += fmt::format("\n  shape mismatches: {}", fmt::join(mismatched, ", "));
    message += "\n  it was probably written for another model or another configuration of it";
    throw Error(ErrorKind::checkpoint, message);
  }
  torch::NoGradGuard no_grad;
  for (const auto& entry : saved) {
    auto it = targets.find(entry.key().toStringRef());
    if (it != targets.end()) it->second.copy_(entry.value().toTensor());
  }
}

c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) { return optimizer_state(optimizer); }

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                               const std::string& origin) {
  load_optimizer_state(optimizer, state, origin);
}

c10::IValue join_checkpoint(const CheckpointParts& parts) {
  auto whole = string_dict();
  if (parts.metadata && parts.metadata->isGenericDict())
    for (const auto& entry : parts.metadata->toGenericDict()) whole.insert(entry.key(), entry.value());
  if (parts.model_state) whole.insert("state_dict", *parts.model_state);
  if (parts.optimizer_states && !parts.optimizer_states->empty()) {
    auto list = any_list();
    for (const auto& s : *parts.optimizer_states) list.push_back(s);
    whole.insert("optimizer_states", list);
  }
  return whole;
}

void split_checkpoint(const c10::IValue& whole, const CheckpointParts& out, const std::string& origin) {
  const auto dict = as_dict(whole, "<top level>", origin);
  auto metadata = string_dict();
  for (const auto& entry : dict) {
    const std::string key = entry.key().isString() ? entry.key().toStringRef() : std::string();
    if (key == "state_dict") {
      if (out.model_state) *out.model_state = entry.value();
    } else if (key == "optimizer_states") {
      if (out.optimizer_states) {
        if (!entry.value().isList())
          throw Error(ErrorKind::checkpoint,
                      fmt::format("checkpoint {}: 'optimizer_states' is not a list; the file is not a Fulgur/Lightning "
                                  "checkpoint",
                                  origin));
        out.optimizer_states->clear();
        for (const c10::IValue& s : entry.value().toList().vec()) out.optimizer_states->push_back(s);
      }
    } else {
      metadata.insert(entry.key(), entry.value());
    }
  }
  if (dict.find("state_dict") == dict.end())
    throw Error(ErrorKind::checkpoint,
                fmt::format("checkpoint {}: key 'state_dict' is missing; it holds no model weights", origin));
  if (out.metadata) *out.metadata = metadata;
}

}  // namespace fulgur
