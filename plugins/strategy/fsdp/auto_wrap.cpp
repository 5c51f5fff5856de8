#include "auto_wrap.h"

#include <fulgur/blocks.h>
#include <fulgur/error.h>
#include <fulgur/log.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <utility>

namespace fulgur::fsdp {
namespace {

// What a Sequential calls in place of a selected element: the element, through fulgur::run_block.
// Not registered as a module anywhere (the element stays registered under its own name).
class BlockCallImpl : public torch::nn::Module {
 public:
  explicit BlockCallImpl(torch::nn::AnyModule inner)
      : inner_(std::make_shared<torch::nn::AnyModule>(std::move(inner))) {}
  at::Tensor forward(const at::Tensor& input) {
    // By value: with activation checkpointing, backward calls the forward again later.
    return fulgur::run_block(*inner_->ptr(), input,
                             [inner = inner_](const at::Tensor& x) { return inner->forward<at::Tensor>(x); });
  }
  const torch::nn::Module* inner() const { return inner_->ptr().get(); }

 private:
  std::shared_ptr<torch::nn::AnyModule> inner_;
};

bool is_container(const torch::nn::Module& module) {
  // FSDP's size policy never wraps ModuleList / ModuleDict (they have no forward); a Sequential
  // does, but only its elements can be routed here.
  return dynamic_cast<const torch::nn::ModuleListImpl*>(&module) ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&module);
}

int64_t own_numel(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const at::Tensor& p : module.parameters(/*recurse=*/false)) n += p.numel();
  return n;
}

// size_based_auto_wrap_policy: children first; a module is a unit when the parameters of it and
// its descendants that no descendant unit took number at least `min_params`. Returns what is left
// to the parent.
int64_t select_by_size(const std::string& name, const std::shared_ptr<torch::nn::Module>& module, bool is_root,
                       int64_t min_params, std::map<const torch::nn::Module*, std::string>& selected) {
  int64_t unwrapped = own_numel(*module);
  for (const auto& child : module->named_children())
    unwrapped += select_by_size(name.empty() ? child.key() : name + "." + child.key(), child.value(), false, min_params,
                                selected);
  if (is_root || is_container(*module) || unwrapped < min_params) return unwrapped;
  selected.emplace(module.get(), name);
  return 0;
}

std::string describe(const torch::nn::Module& module, const std::string& name) {
  int64_t n = 0;
  for (const at::Tensor& p : module.parameters()) n += p.numel();
  return fmt::format("'{}' ({}, {} parameters)", name, module.name(), n);
}

}  // namespace

bool class_matches(const torch::nn::Module& module, const std::string& name) {
  const std::string full = module.name();
  auto without_impl = [](std::string_view s) { return s.ends_with("Impl") ? s.substr(0, s.size() - 4) : s; };
  auto last = [](std::string_view s) {
    const size_t colon = s.rfind("::");
    return colon == std::string_view::npos ? s : s.substr(colon + 2);
  };
  const std::string_view f = full;
  return name == f || name == without_impl(f) || name == last(f) || name == last(without_impl(f));
}

AutoWrapped auto_wrap(torch::nn::Module& model, const AutoWrapPolicy& policy) {
  AutoWrapped result;
  if (policy.kind == AutoWrapPolicy::Kind::blocks || policy.kind == AutoWrapPolicy::Kind::root) return result;

  // The submodules the policy selects, by address, with their dotted names.
  std::map<const torch::nn::Module*, std::string> selected;
  if (policy.kind == AutoWrapPolicy::Kind::size) {
    // The root stays the root unit (FSDP wraps it last, around whatever is left).
    std::shared_ptr<torch::nn::Module> root(&model, [](torch::nn::Module*) {});
    select_by_size("", root, /*is_root=*/true, policy.min_params, selected);
  } else {
    for (const auto& item : model.named_modules("", /*include_self=*/false))
      for (const std::string& wanted : policy.modules)
        if (class_matches(*item.value(), wanted)) selected.emplace(item.value().get(), item.key());
  }

  // Reported in the model's own order: `selected` is ordered by address, which differs between runs.
  std::vector<const torch::nn::Module*> in_model_order;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (selected.contains(item.value().get()) &&
        std::ranges::find(in_model_order, item.value().get()) == in_model_order.end())
      in_model_order.push_back(item.value().get());

  // Route each selected element of a Sequential through run_block; an element routed on an earlier
  // stage counts as routed.
  std::set<const torch::nn::Module*> routed;
  // The root by reference (modules(include_self) needs it owned by a shared_ptr), then the rest.
  std::vector<torch::nn::SequentialImpl*> sequentials;
  if (auto* root = model.as<torch::nn::SequentialImpl>()) sequentials.push_back(root);
  for (const auto& module : model.modules(/*include_self=*/false))
    if (auto* sequential = module->as<torch::nn::SequentialImpl>()) sequentials.push_back(sequential);
  for (torch::nn::SequentialImpl* sequential : sequentials) {
    for (torch::nn::AnyModule& element : *sequential) {
      if (const auto* call = element.ptr()->as<BlockCallImpl>()) {
        routed.insert(call->inner());
        continue;
      }
      if (!selected.contains(element.ptr().get())) continue;
      routed.insert(element.ptr().get());
      element = torch::nn::AnyModule(std::make_shared<BlockCallImpl>(element));
    }
  }

  std::vector<std::string> unreachable;
  for (const torch::nn::Module* module : in_model_order)
    if (!routed.contains(module)) unreachable.push_back(describe(*module, selected.at(module)));
  const std::string policy_text =
      policy.kind == AutoWrapPolicy::Kind::size
          ? fmt::format("auto_wrap_policy = \"size\" (auto_wrap_min_params = {})", policy.min_params)
          : fmt::format("auto_wrap_policy = \"modules\" (auto_wrap_modules = [\"{}\"])",
                        fmt::join(policy.modules, "\", \""));
  if (!unreachable.empty())
    throw Error(
        ErrorKind::config,
        fmt::format("strategy 'fsdp': {} selects {} submodule(s) whose forward the model's own code calls: {}. "
                    "LibTorch modules have no forward hooks, so zero_stage = 3 can gather a submodule's parameters "
                    "around its forward only when it runs through fulgur::run_block: call it as "
                    "`x = fulgur::run_block(layer, x)` in the Module's forward (fulgur/blocks.h), or hold it in a "
                    "torch::nn::Sequential, whose elements the policy routes there; or select other modules",
                    policy_text, unreachable.size(), fmt::join(unreachable, ", ")));
  if (routed.empty())
    throw Error(ErrorKind::config,
                fmt::format("strategy 'fsdp': {} selects no submodule of the model{}; lower auto_wrap_min_params, name "
                            "other classes in auto_wrap_modules (a module's class is what Module::name() says, "
                            "e.g. \"torch::nn::Linear\" or \"Linear\"), or run the model's layers through "
                            "fulgur::run_block",
                            policy_text,
                            policy.kind == AutoWrapPolicy::Kind::size ? " (none holds that many parameters)" : ""));
  result.units = static_cast<int64_t>(routed.size());
  if (log::enabled(log::Level::debug)) {
    std::vector<std::string> names;
    for (const torch::nn::Module* module : in_model_order) names.push_back(describe(*module, selected.at(module)));
    log::debug(
        fmt::format("strategy 'fsdp': {} makes {} unit(s): {}", policy_text, result.units, fmt::join(names, ", ")));
  }
  return result;
}

}  // namespace fulgur::fsdp
