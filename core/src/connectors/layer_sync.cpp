#include "layer_sync.h"

#include <fulgur/communicator.h>
#include <fulgur/error.h>
#include <fulgur/nn/batch_norm.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/nn/modules/batchnorm.h>

#include <string>
#include <vector>

namespace fulgur {
namespace {

// PyTorch's convert_sync_batchnorm converts these; LibTorch's parents call them through typed
// members, so a converted registration would never run.
const char* torch_batch_norm_kind(torch::nn::Module& layer) {
  if (dynamic_cast<torch::nn::BatchNorm1dImpl*>(&layer)) return "torch::nn::BatchNorm1d";
  if (dynamic_cast<torch::nn::BatchNorm2dImpl*>(&layer)) return "torch::nn::BatchNorm2d";
  if (dynamic_cast<torch::nn::BatchNorm3dImpl*>(&layer)) return "torch::nn::BatchNorm3d";
  return nullptr;
}

}  // namespace

void apply_layer_sync(torch::nn::Module& model, bool sync_batchnorm, const LayerSyncGroup& group) {
  std::vector<nn::BatchNormImpl*> layers;
  std::vector<std::string> unconvertible;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto* layer = dynamic_cast<nn::BatchNormImpl*>(item.value().get()))
      layers.push_back(layer);
    else if (const char* kind = torch_batch_norm_kind(*item.value()))
      unconvertible.push_back(fmt::format("'{}' ({})", item.key(), kind));
  }
  const int64_t ranks = group.communicator ? group.communicator->world_size() : 1;
  const bool synchronize = sync_batchnorm && ranks > 1;
  if (sync_batchnorm && !unconvertible.empty())
    throw Error(ErrorKind::config,
                fmt::format("[trainer] sync_batchnorm = true: the model's batch-norm layer{} {} cannot be synchronized "
                            "(LibTorch calls a layer through its parent's typed member, so it cannot be swapped for a "
                            "synchronized one as PyTorch's convert_sync_batchnorm does). Declare {} as "
                            "fulgur::nn::BatchNorm (fulgur/nn/batch_norm.h: the same parameters, buffers and "
                            "results), or set sync_batchnorm = false.",
                            unconvertible.size() == 1 ? "" : "s", fmt::join(unconvertible, ", "),
                            unconvertible.size() == 1 ? "it" : "them"));
  if (synchronize && group.data_parallel_size != ranks)
    throw Error(ErrorKind::config,
                fmt::format("[trainer] sync_batchnorm = true: strategy '{}' trains {} data-parallel replicas on {} "
                            "ranks; batch-norm statistics are synchronized over the whole run only. Set "
                            "sync_batchnorm = false.",
                            group.strategy, group.data_parallel_size, ranks));
  for (nn::BatchNormImpl* layer : layers) layer->synchronize_with(synchronize ? group.communicator : nullptr);
  if (!sync_batchnorm) return;
  if (layers.empty())
    spdlog::warn(
        "[trainer] sync_batchnorm = true, but the model has no fulgur::nn::BatchNorm layer: nothing to "
        "synchronize");
  else if (synchronize)
    spdlog::info("sync_batchnorm: {} fulgur::nn::BatchNorm layer{} normalize with the statistics of all {} ranks",
                 layers.size(), layers.size() == 1 ? "" : "s", ranks);
  else
    spdlog::info("sync_batchnorm: one process, so the {} fulgur::nn::BatchNorm layer{} use this process's batch",
                 layers.size(), layers.size() == 1 ? "" : "s");
}

}  // namespace fulgur
