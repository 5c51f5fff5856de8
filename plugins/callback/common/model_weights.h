// Helpers for the built-in callbacks that read and change a model's weights and its optimizers'
// parameter groups (ema, swa, backbone_finetuning, freeze_schedule, spike_detection,
// model_pruning): named tensors of the user's module, an averaged copy of them that can be swapped
// in and out, storing tensors in callback state, parameter-name patterns, adding a parameter
// group, and the one-process rule for changing which parameters train. Header-only: each callback is its own plugin
// library and may use only the SDK.
#pragma once

#include <fulgur/blocks.h>
#include <fulgur/error.h>
#include <fulgur/trainer_context.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <ATen/ops/empty_like.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <fnmatch.h>

#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fulgur::model_weights {

// One tensor of the model under its dotted Python name ("features.0.weight").
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
  bool is_buffer = false;
};

// The model's parameters, then (with_buffers) its buffers, in registration order.
inline std::vector<NamedTensor> model_tensors(torch::nn::Module& model, bool with_buffers) {
  std::vector<NamedTensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) out.push_back({item.key(), item.value(), false});
  if (with_buffers)
    for (const auto& item : model.named_buffers(/*recurse=*/true)) out.push_back({item.key(), item.value(), true});
  return out;
}

// Whether a module tracks running statistics (BatchNorm, InstanceNorm with track_running_stats):
// the first such buffer's name, empty when there is none.
inline std::string running_stats_buffer(torch::nn::Module& model) {
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    const std::string& name = item.key();
    auto ends_with = [&](std::string_view suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (name == "running_mean" || ends_with(".running_mean") || name == "running_var" || ends_with(".running_var"))
      return name;
  }
  return {};
}

inline std::string shape(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
  return out + "]";
}

// An average of a model's tensors kept beside it (ema, swa). Floating tensors are averaged;
// others (BatchNorm's num_batches_tracked) are copied on each update.
//
// Under a strategy that shards parameters (fsdp, zero_stage = 3) they hold no values outside the
// blocks that use them: every method that reads or writes the model's tensors makes them whole
// first with fulgur::FullParameters (a collective: every rank calls these methods together, as
// the callbacks do, with the same decisions), and the strategy writes what was changed back to its
// shards when the guard goes. The average itself is whole on every rank, as under ddp. Without
// sharding the guard does nothing.
class AveragedWeights {
 public:
  // `device` empty: where the model's tensors are. `model` must outlive this object's use.
  void init(torch::nn::Module& model, bool with_buffers, const std::string& device) {
    model_ = &model;
    FullParameters whole(model);
    live_ = model_tensors(model, with_buffers);
    average_.clear();
    backup_.clear();
    device_ = device;
    at::NoGradGuard no_grad;
    for (const auto& t : live_) {
      at::Tensor copy = t.tensor.detach().clone();
      average_.push_back(device.empty() ? copy : copy.to(c10::Device(device)));
    }
    n_averaged_ = 0;
    swapped_ = false;
  }
  bool initialized() const { return !live_.empty() || !average_.empty(); }
  int64_t n_averaged() const { return n_averaged_; }
  const std::vector<NamedTensor>& live() const { return live_; }
  const std::vector<at::Tensor>& average() const { return average_; }

  // AveragedModel.update_parameters: the first update copies the weights; later ones mix them in
  // with `weight_of_new(n_averaged)` (EMA: 1 - decay; a plain mean: 1 / (n + 1)).
  template <class WeightOfNew>
  void update(WeightOfNew weight_of_new) {
    FullParameters whole(*model_);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < live_.size(); ++i) {
      at::Tensor source = live_[i].tensor.detach();
      at::Tensor& avg = average_[i];
      if (n_averaged_ == 0 || !at::isFloatingType(avg.scalar_type())) {
        avg.copy_(source);
      } else {
        avg.lerp_(source.to(avg.device()), weight_of_new(n_averaged_));
      }
    }
    ++n_averaged_;
  }

  // Puts the average into the model, keeping the model's own values to put back.
  void swap_in() {
    if (swapped_) return;
    FullParameters whole(*model_);
    at::NoGradGuard no_grad;
    if (backup_.size() != live_.size()) {
      backup_.clear();
      for (const auto& t : live_) backup_.push_back(at::empty_like(t.tensor));
    }
    for (size_t i = 0; i < live_.size(); ++i) {
      backup_[i].copy_(live_[i].tensor.detach());
      live_[i].tensor.detach().copy_(average_[i]);
    }
    swapped_ = true;
  }
  void swap_out() {
    if (!swapped_) return;
    FullParameters whole(*model_);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < live_.size(); ++i) live_[i].tensor.detach().copy_(backup_[i]);
    swapped_ = false;
  }
  bool swapped() const { return swapped_; }
  // Copies the average into the model for good.
  void copy_to_model() {
    FullParameters whole(*model_);
    at::NoGradGuard no_grad;
    swapped_ = false;
    for (size_t i = 0; i < live_.size(); ++i) live_[i].tensor.detach().copy_(average_[i]);
  }

  // {"n_averaged": int, "average": {name: tensor}} (tensors on cpu, so any process can read them).
  c10::impl::GenericDict to_state() const {
    c10::impl::GenericDict tensors(c10::StringType::get(), c10::TensorType::get());
    for (size_t i = 0; i < live_.size(); ++i) tensors.insert(live_[i].name, average_[i].detach().to(at::kCPU));
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    state.insert("n_averaged", n_averaged_);
    state.insert("average", tensors);
    return state;
  }
  // Restores what to_state wrote; init() must have run (the model's tensors define the layout).
  void from_state(std::string_view owner, const c10::impl::GenericDict& state) {
    auto n = state.find("n_averaged");
    auto avg = state.find("average");
    if (n == state.end() || avg == state.end() || !avg->value().isGenericDict())
      throw Error(ErrorKind::checkpoint,
                  fmt::format("{}: the checkpoint's state has no 'n_averaged' / 'average' entries; it was not "
                              "written by this callback",
                              owner));
    const auto tensors = avg->value().toGenericDict();
    std::vector<std::string> missing;
    for (const auto& t : live_)
      if (tensors.find(t.name) == tensors.end()) missing.push_back(t.name);
    if (!missing.empty() || tensors.size() != live_.size())
      throw Error(ErrorKind::checkpoint,
                  fmt::format("{}: the averaged weights in the checkpoint do not match the model ({} tensors saved, "
                              "{} in the model{}); resume with the model the checkpoint was written for",
                              owner, tensors.size(), live_.size(),
                              missing.empty() ? std::string() : fmt::format("; missing e.g. '{}'", missing.front())));
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < live_.size(); ++i) {
      const at::Tensor saved = tensors.at(live_[i].name).toTensor();
      if (saved.sizes() != average_[i].sizes())
        throw Error(ErrorKind::checkpoint, fmt::format("{}: averaged '{}' has shape {} in the checkpoint, {} in the "
                                                       "model",
                                                       owner, live_[i].name, shape(saved), shape(average_[i])));
      average_[i].copy_(saved);
    }
    n_averaged_ = n->value().toInt();
  }

 private:
  torch::nn::Module* model_ = nullptr;
  std::vector<NamedTensor> live_;
  std::vector<at::Tensor> average_;
  std::vector<at::Tensor> backup_;
  std::string device_;
  int64_t n_averaged_ = 0;
  bool swapped_ = false;
};

// --- parameter names and optimizer groups --------------------------------------------------------

// Shell-style pattern on dotted names ("features.*", "*.bias"); '*' also crosses dots.
inline bool name_matches(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

// The parameter's group index in `optimizer`, -1 when no group holds it.
inline int64_t group_of(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params())
      if (p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return static_cast<int64_t>(g);
  return -1;
}

// Takes `params` out of whichever group of `optimizer` holds them (only safe before the optimizer
// has state for them: at fit start). Returns how many were removed.
inline size_t remove_from_groups(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params) {
  std::set<const void*> wanted;
  for (const auto& p : params) wanted.insert(p.unsafeGetTensorImpl());
  size_t removed = 0;
  for (auto& group : optimizer.param_groups()) {
    auto& list = group.params();
    const size_t before = list.size();
    std::erase_if(list, [&](const at::Tensor& p) { return wanted.count(p.unsafeGetTensorImpl()) != 0; });
    removed += before - list.size();
  }
  return removed;
}

// A new parameter group holding `params`, with the first group's hyperparameters and `lr`
// (torch.optim's add_param_group: Lightning's unfreeze_and_add_param_group goes through it).
inline void add_param_group(torch::optim::Optimizer& optimizer, std::vector<at::Tensor> params, double lr) {
  if (params.empty()) return;
  if (optimizer.param_groups().empty())
    throw Error(ErrorKind::invalid_argument, "the optimizer has no parameter group to copy hyperparameters from");
  std::unique_ptr<torch::optim::OptimizerOptions> options = optimizer.param_groups().front().options().clone();
  options->set_lr(lr);
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(std::move(params), std::move(options)));
}

// For the callbacks that freeze and unfreeze parameters during a run (backbone_finetuning,
// freeze_schedule), at fit start: refused with several processes. The data-parallel strategy
// decides which gradients it all-reduces from requires_grad at the first backward, and the
// contract has no way to tell it that the set changed: parameters unfrozen later would train on
// each rank's own gradients and the replicas would drift apart.
inline void require_one_process_to_change_trainable(const TrainerContext& trainer, std::string_view owner) {
  const int64_t world_size = trainer.cluster().world_size;
  if (world_size > 1)
    throw Error(ErrorKind::config,
                fmt::format("{}: changing which parameters train during a run is not supported with several "
                            "processes (world size {}): the strategy fixes the gradients it synchronizes at the "
                            "first backward. Train in one process, or freeze the parameters in the Module itself",
                            owner, world_size));
}

}  // namespace fulgur::model_weights
