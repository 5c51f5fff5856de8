// The Strategy defaults: what a replicated strategy does with model and optimizer state and with
// checkpoints (sharded strategies override these).
#include <fulgur/checkpoint_io.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>
#include <fulgur/precision.h>
#include <fulgur/state_dict.h>
#include <fulgur/storage.h>
#include <fulgur/strategy.h>

#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <system_error>

namespace fulgur {

void Strategy::configure_model(torch::nn::Module&, const ModelBuild& build) {
  if (build.configure) build.configure();
}

void Strategy::setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>&) {}

void Strategy::clip_gradients(torch::optim::Optimizer& optimizer, Precision& precision, double clip_value,
                              GradClipAlgorithm algorithm) {
  precision.clip_gradients(optimizer, clip_value, algorithm);
}

c10::IValue Strategy::module_state_dict(torch::nn::Module& module) { return fulgur::module_state_dict(module); }

void Strategy::load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                                      const std::string& origin) {
  fulgur::load_module_state_dict(module, state, strict, origin);
}

c10::IValue Strategy::optimizer_state_dict(torch::optim::Optimizer& optimizer) {
  return fulgur::optimizer_state_dict(optimizer);
}

void Strategy::load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                         const std::string& origin) {
  fulgur::load_optimizer_state_dict(optimizer, state, origin);
}

void Strategy::save_checkpoint(const CheckpointParts& parts, const std::string& path) {
  if (is_global_zero()) {
    // Like Lightning's TorchCheckpointIO, a checkpoint may go to a directory that does not exist yet.
    // Object stores have no directories to create.
    const std::filesystem::path parent =
        is_storage_url(path) ? std::filesystem::path() : std::filesystem::path(path).parent_path();
    std::error_code error;
    if (!parent.empty()) std::filesystem::create_directories(parent, error);
    if (error)
      throw Error(ErrorKind::io, fmt::format("cannot write checkpoint '{}': creating directory '{}' failed: {}", path,
                                             parent.string(), error.message()));
    write_checkpoint_file(join_checkpoint(parts), path);
  }
  // Nobody reads the file before it is complete on disk.
  if (cluster().world_size > 1) barrier("save_checkpoint");
}

// A sharded checkpoint (a DCP directory, written by a sharded strategy or by PyTorch) is read whole:
// any strategy resumes from one, whatever world size wrote it.
void Strategy::load_checkpoint(const std::string& path, const CheckpointParts& out) {
  if (dcp::is_distributed_checkpoint(path)) {
    split_checkpoint(dcp::Reader(path).read_all(), out, path);
    // DCP stores dict keys as strings: torch.optim's per-parameter state comes back keyed "0",
    // "1", ...; they are parameter indices again.
    if (out.optimizer_states)
      for (c10::IValue& optimizer : *out.optimizer_states) optimizer = dcp::with_index_keys(optimizer);
    return;
  }
  split_checkpoint(read_checkpoint_file(path), out, path);
}

bool Strategy::is_checkpoint(const std::string& path) const {
  if (is_storage_url(path)) return storage_for(path).exists(path);
  std::error_code error;
  return std::filesystem::is_regular_file(path, error) || dcp::is_distributed_checkpoint(path);
}

}  // namespace fulgur
