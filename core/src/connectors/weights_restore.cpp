// The model's weights from files that are not a run to resume: [trainer] init_weights (a
// fine-tuning start), and a safetensors file or bare state dict given as ckpt_path to validate,
// test or predict. Both reuse fulgur::read_weights and load_weights' key mapping and fit check
// (weights_fit.h), then go through the strategy as a checkpoint's weights do. Also the refusal of
// a checkpoint that fit cannot resume (one written by Python's Lightning, or bare weights).
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>
#include <fulgur/nn/linear.h>
#include <fulgur/weights.h>

#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/nn/module.h>

#include <filesystem>
#include <map>
#include <system_error>

#include "../ivalue_dict.h"
#include "../trainer_engine.h"
#include "../weights_fit.h"
#include "checkpoint_connector.h"

namespace fulgur {

namespace {

// The module's names and shapes as its strategy saves them (a sharded strategy: whole tensors).
TensorMap module_targets(Strategy& strategy, Module& module) {
  TensorMap targets;
  const c10::IValue state = strategy.module_state_dict(module);
  for (const auto& entry : state.toGenericDict()) targets.emplace(entry.key().toStringRef(), entry.value().toTensor());
  return targets;
}

// `text` inside a fmt pattern: its braces doubled (a path may hold any character).
std::string fmt_literal(const std::string& text) {
  std::string out;
  for (char c : text) {
    out += c;
    if (c == '{' || c == '}') out += c;
  }
  return out;
}

std::string format_name(const std::string& path) {
  return detect_weights_format(path) == WeightsFormat::safetensors ? "safetensors" : "torch.save";
}

}  // namespace

void CheckpointConnector::load_init_weights(Stage stage) {
  TrainerEngine& t = trainer_;
  const ResolvedTrainerConfig::InitWeights& init = t.trainer_config_.init_weights;
  if (init.path.empty()) return;
  Module& module = *t.module_;
  LoadWeightsOptions options;
  options.strict(init.strict).strip_prefix(init.strip_prefix).add_prefix(init.add_prefix);
  detail::WeightsHintSpelling spelling;
  spelling.strip_prefix = "[trainer] init_weights_strip_prefix = \"{}\"";
  spelling.add_prefix = "[trainer] init_weights_add_prefix = \"{}\"";
  spelling.not_strict = "[trainer] init_weights_strict = false";
  spelling.skip_mismatched = "";
  LoadReport report;
  const TensorMap tensors = read_weights(init.path);
  const auto state =
      detail::fit_weights(module_targets(*t.plugins_.strategy, module), tensors, options,
                          fmt::format("[trainer] init_weights = \"{}\"", init.path), module.name(), report, spelling);
  t.plugins_.strategy->load_module_state_dict(module, state, /*strict=*/false, init.path);
  if (t.global_rank() != 0) return;
  spdlog::info("{}: initial weights loaded from {} ({} tensors)", to_string(stage), init.path, report.loaded);
  if (!report.complete()) spdlog::warn("[trainer] init_weights = \"{}\": {}", init.path, report.to_string());
}

bool CheckpointConnector::is_weights_only_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;  // a DCP directory is a checkpoint
  return detect_weights_format(path) == WeightsFormat::safetensors;
}

void CheckpointConnector::restore_weights_only(const std::string& path, const TensorMap& tensors) {
  TrainerEngine& t = trainer_;
  Module& module = *t.module_;
  LoadWeightsOptions options;
  options.strict(t.trainer_config_.strict_loading);
  // A file given as ckpt_path is loaded with its keys as they are; mapping them is init_weights' job.
  detail::WeightsHintSpelling spelling;
  spelling.strip_prefix =
      fmt::format("[trainer] init_weights = \"{}\" with init_weights_strip_prefix = \"{{}}\" instead of ckpt_path",
                  fmt_literal(path));
  spelling.add_prefix =
      fmt::format("[trainer] init_weights = \"{}\" with init_weights_add_prefix = \"{{}}\" instead of ckpt_path",
                  fmt_literal(path));
  spelling.not_strict = "[trainer] strict_loading = false";
  spelling.skip_mismatched = "";
  // A file `fulgur weights convert` made of an LSQ checkpoint holds the learned scales too (a
  // `fulgur quantize` file's layers are quantized by now, and float layers are the only ones asked).
  prepare_learned_scales(tensors, path, /*optimizers_set=*/false);
  LoadReport report;
  const auto state = detail::fit_weights(module_targets(*t.plugins_.strategy, module), tensors, options, path,
                                         module.name(), report, spelling);
  t.plugins_.strategy->load_module_state_dict(module, state, /*strict=*/false, path);
  if (t.global_rank() != 0) return;
  spdlog::info("Loaded the model's weights only from {} ({}, {} tensors): it holds no training state", path,
               format_name(path), report.loaded);
  if (!report.complete()) spdlog::warn("ckpt_path {}: {}", path, report.to_string());
}

void CheckpointConnector::restore_model_for(Stage stage, const std::string& ckpt_path) {
  TrainerEngine& t = trainer_;
  if (ckpt_path.empty()) {
    load_init_weights(stage);
    return;
  }
  const std::string path = resolve(ckpt_path, stage);
  const std::string shown = std::filesystem::absolute(path).lexically_normal().string();
  if (t.global_rank() == 0) spdlog::info("Restoring states from the checkpoint path at {}", shown);
  if (is_weights_only_file(path)) {
    std::map<std::string, std::string> metadata;
    const TensorMap tensors = read_safetensors(path, &metadata);
    // Weights `fulgur quantize` wrote: the model's fulgur::nn::Linear layers take the quantized form
    // the metadata names before the load compares keys and shapes.
    if (nn::prepare_quantized_layers(*t.module_, metadata) && t.global_rank() == 0)
      spdlog::info("{}: serving the layers {} with {} weights", path, metadata.at("fulgur.quantized_layers"),
                   metadata.at(nn::kQuantizationMetadataKey));
    restore_weights_only(path, tensors);
    return;
  }
  ReadCheckpoint checkpoint;
  try {
    checkpoint = read(path, /*with_optimizer_states=*/false);
  } catch (const Error& e) {
    // A torch.save(model.state_dict()) file: no "state_dict" entry, the dict itself is the weights.
    if (e.kind() != ErrorKind::checkpoint || dcp::is_distributed_checkpoint(path)) throw;
    TensorMap tensors;
    try {
      tensors = read_weights(path, WeightsFormat::torch);
    } catch (const Error&) {
      throw e;  // neither a checkpoint nor a state dict: the checkpoint reader's reason
    }
    restore_weights_only(path, tensors);
    return;
  }
  restore_model(checkpoint, stage);
}

void CheckpointConnector::prepare_learned_scales(const TensorMap& state, const std::string& path, bool optimizers_set) {
  TrainerEngine& t = trainer_;
  std::map<std::string, at::Tensor> params;
  for (const auto& item : t.module_->named_parameters(/*recurse=*/true)) params.emplace(item.key(), item.value());
  const auto has = [&](const std::string& key, const at::Tensor& like) {
    const auto p = params.find(key);
    return p != params.end() && p->second.defined() && p->second.sizes() == like.sizes();
  };
  // Only the layers that lack what the state holds: a layer the qat callback (or a first load)
  // set up keeps its parameters, which the optimizers may hold already.
  std::map<std::string, at::Tensor> missing;
  for (const auto& [key, value] : state) {
    if (!key.ends_with("weight_scale") || !value.defined()) continue;
    const std::string prefix = key.substr(0, key.size() - std::string("weight_scale").size());
    const auto input = state.find(prefix + "input_scale");
    if (has(key, value) && (input == state.end() || has(input->first, input->second))) continue;
    missing.emplace(key, value);
    if (input != state.end()) missing.emplace(input->first, input->second);
  }
  if (missing.empty()) return;
  const std::vector<std::string> layers = nn::prepare_learned_scales(*t.module_, missing);
  if (layers.empty()) return;  // not fulgur::nn::Linear layers: the load names the keys
  if (optimizers_set)
    throw Error(ErrorKind::checkpoint,
                fmt::format("ckpt_path {}: the layers {} learned their quantization scales (LSQ) in the run that "
                            "wrote it, and this fit's model has no such parameters for its optimizers to train; "
                            "resume with the same quantization-aware training: the callback that trained it with "
                            "learnable scales on, or "
                            "fulgur::nn::quantization_aware_training(..., QatOptions(...).learnable_scales(true)) "
                            "in the model's constructor",
                            path, fmt::join(layers, ", ")));
  if (t.global_rank() == 0)
    spdlog::info("{}: the layers {} serve with the quantization scales they learned (LSQ)", path,
                 fmt::join(layers, ", "));
}

std::string CheckpointConnector::init_weights_hint(const std::string& path) {
  return fmt::format(
      "to start a new fit from its weights, set [trainer] init_weights = \"{}\" (init_weights_strip_prefix = "
      "\"model.\" and the like map its keys) and leave ckpt_path empty",
      path);
}

CheckpointConnector::ReadCheckpoint CheckpointConnector::read_for_resume(const std::string& path) {
  auto weights_only = [&] {
    return Error(ErrorKind::checkpoint,
                 fmt::format("ckpt_path {}: the file holds weights only ({}), and fit resumes a run from a checkpoint "
                             "with its training state; {}",
                             path, format_name(path), init_weights_hint(path)));
  };
  if (is_weights_only_file(path)) throw weights_only();
  ReadCheckpoint checkpoint;
  try {
    checkpoint = read(path, /*with_optimizer_states=*/true);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::checkpoint || dcp::is_distributed_checkpoint(path)) throw;
    bool state_dict = false;
    try {
      state_dict = !read_weights(path, WeightsFormat::torch).empty();
    } catch (const Error&) {
    }
    if (state_dict) throw weights_only();
    throw;
  }
  check_resumable(checkpoint);
  return checkpoint;
}

void CheckpointConnector::check_resumable(const ReadCheckpoint& checkpoint) {
  const auto& ckpt = checkpoint.metadata->toGenericDict();
  const std::string& path = checkpoint.path;
  const std::string hint = init_weights_hint(path);
  // Fulgur's own loop state (position, RNG, ...) is what an exact resume needs; Lightning's
  // checkpoints carry only Lightning's progress counters in `loops`.
  const auto loops = get(ckpt, "loops");
  const auto fit_loop =
      loops && loops->isGenericDict() ? get(loops->toGenericDict(), "fit_loop") : std::optional<c10::IValue>();
  const bool fulgur_loop = fit_loop && fit_loop->isGenericDict() && fit_loop->toGenericDict().contains("epoch") &&
                           fit_loop->toGenericDict().contains("cpu_rng_state");
  if (fulgur_loop || get(ckpt, "fulgur_version")) return;
  if (auto lightning = get(ckpt, "pytorch-lightning_version"))
    throw Error(ErrorKind::checkpoint,
                fmt::format("ckpt_path {} was written by PyTorch Lightning {}, not by Fulgur: its loop state "
                            "(Lightning's progress counters, without Fulgur's position, data order and RNG state) "
                            "cannot be resumed exactly; {}",
                            path, lightning->isString() ? lightning->toStringRef() : std::string("?"), hint));
  if (!loops)
    throw Error(ErrorKind::checkpoint,
                fmt::format("ckpt_path {} holds weights but no training state (no 'loops' entry): fit resumes only "
                            "a checkpoint a Fulgur run wrote; {}",
                            path, hint));
}

}  // namespace fulgur
