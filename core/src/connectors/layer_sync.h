// [trainer] sync_batchnorm: Lightning's LayerSync (TorchSyncBatchNorm) for LibTorch models.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

namespace torch::nn {
class Module;
}

namespace fulgur {

class Communicator;

/// What the model's batch-norm layers synchronize over: the run's communicator and the
/// strategy's data-parallel size (they must describe the same ranks).
struct LayerSyncGroup {
  std::shared_ptr<Communicator> communicator;  // null in a single process
  int64_t data_parallel_size = 1;
  std::string_view strategy;  // for messages
};

/// Connects every fulgur::nn::BatchNorm of `model` to `group` when `sync_batchnorm` is set and the
/// run has more than one data-parallel rank, and makes them local otherwise. Runs after the
/// Module's configure_model and before the strategy's setup_module (Lightning converts the layers
/// before wrapping the model). With sync_batchnorm set, refuses torch::nn::BatchNorm{1,2,3}d layers
/// (LibTorch cannot swap them for synchronized ones) naming each, and a strategy whose
/// data-parallel group is not the whole run.
void apply_layer_sync(torch::nn::Module& model, bool sync_batchnorm, const LayerSyncGroup& group);

}  // namespace fulgur
