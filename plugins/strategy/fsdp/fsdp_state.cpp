#include "fsdp_state.h"

#include "../common/optimizer_state_map.h"

#include <fulgur/error.h>
#include <fulgur/log.h>
#include <fulgur/state_dict.h>

#include <ATen/core/Dict.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/utils.h>

#include <cstdio>
#include <optional>
#include <set>
#include <string_view>

namespace fulgur::fsdp {
namespace {

// `state` in torch.optim's layout with every per-element tensor of a parameter's state (each but
// "step") replaced by fn(parameter, index, name, tensor): gathered, cut or kept; nullopt leaves it
// out (optimizer_state::map_parameter_states walks the layout).
template <class Fn>
c10::IValue map_parameter_states(const c10::IValue& state, const std::vector<ShardedParameter*>& order, Fn&& fn) {
  return optimizer_state::map_parameter_states(state, static_cast<int64_t>(order.size()),
                                               [&](int64_t index, const std::string& name, const at::Tensor& tensor) {
                                                 return fn(*order[static_cast<size_t>(index)], index, name, tensor);
                                               });
}

// Where this rank's rows of `p` sit in the whole tensor; nullopt when it holds none of them or
// the tensor is not split (a 0-dim parameter: rank 0 writes it, as a replicated tensor).
std::optional<dcp::Chunk> chunk_of(const ShardedParameter& p) {
  if (p.full.dim() == 0) return std::nullopt;
  std::vector<int64_t> offsets(p.full.dim(), 0);
  offsets[0] = p.begin;
  return dcp::Chunk().set_global_shape(p.full.sizes().vec()).set_offsets(std::move(offsets));
}

}  // namespace

c10::IValue sharded_module_state(torch::nn::Module& module, const Shards& shards, Placements& placements) {
  placements.clear();
  auto state = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : module.named_parameters()) {
    auto found = shards.by_tensor.find(item.value().unsafeGetTensorImpl());
    if (found == shards.by_tensor.end()) {  // not split (no optimizer set up yet): whole, like a buffer
      state.insert(item.key(), item.value().detach());
      continue;
    }
    const ShardedParameter& p = found->second;
    if (p.local_rows() == 0) continue;  // nothing of it here
    state.insert(item.key(), p.shard.detach());
    if (auto chunk = chunk_of(p)) placements["state_dict." + item.key()] = *chunk;
  }
  for (const auto& item : module.named_buffers()) state.insert(item.key(), item.value().detach());
  return state;
}

c10::IValue gathered_optimizer_state(const c10::IValue& local, const std::vector<ShardedParameter*>& order,
                                     const RankGroup& group) {
  return map_parameter_states(local, order,
                              [&](const ShardedParameter& p, int64_t, const std::string&, const at::Tensor& t) {
                                return std::optional<at::Tensor>(gather_rows(p, t, group));
                              });
}

c10::IValue sharded_optimizer_state(const c10::IValue& local, const std::vector<ShardedParameter*>& order,
                                    int64_t optimizer_index, Placements& placements) {
  return map_parameter_states(
      local, order,
      [&](const ShardedParameter& p, int64_t index, const std::string& name,
          const at::Tensor& t) -> std::optional<at::Tensor> {
        if (p.local_rows() == 0) return std::nullopt;  // nothing of it here
        if (auto chunk = chunk_of(p))
          placements[fmt::format("optimizer_states.{}.state.{}.{}", optimizer_index, index, name)] = *chunk;
        return t;
      });
}

c10::IValue local_optimizer_state(const c10::IValue& state, const std::vector<ShardedParameter*>& order,
                                  const std::string& origin) {
  return map_parameter_states(
      state, order,
      [&](const ShardedParameter& p, int64_t, const std::string&, const at::Tensor& t) -> std::optional<at::Tensor> {
        // This rank's rows already (read so from a sharded checkpoint under stage 3).
        if (p.is_local_rows(t)) return t.to(p.stepped().device()).clone();
        if (t.numel() != p.full.numel())
          throw Error(ErrorKind::checkpoint,
                      fmt::format("{}: an optimizer state tensor of {} elements for a parameter of {} (shape {}); "
                                  "the checkpoint belongs to another model",
                                  origin, t.numel(), p.full.numel(), fmt::join(p.full.sizes(), "x")));
        return p.rows_of(t.to(p.stepped().device()), p.begin, p.local_rows()).clone().reshape(p.shard_shape());
      });
}

void read_local_rows(const std::string& path, const CheckpointParts& out, const Shards& shards, int64_t rank) {
  const dcp::Reader reader(path);
  int64_t row_bytes = 0, whole_bytes = 0, sliced = 0;
  auto rows = [&](const ShardedParameter& p, const std::string& key) -> at::Tensor {
    if (p.full.dim() == 0 || reader.shape(key) != p.full.sizes().vec()) return {};  // whole; the loaders judge it
    std::vector<int64_t> offsets(p.full.dim(), 0), sizes = p.full.sizes().vec();
    offsets[0] = p.begin;
    sizes[0] = p.local_rows();
    at::Tensor t = reader.read(key, offsets, sizes);
    row_bytes += static_cast<int64_t>(t.nbytes());
    whole_bytes += p.full.numel() * static_cast<int64_t>(c10::elementSize(reader.dtype(key)));
    ++sliced;
    return t;
  };
  const c10::IValue whole = reader.read_all([&](const std::string& key) -> at::Tensor {
    if (key.starts_with("state_dict.")) {
      auto found = shards.named.find(key.substr(std::string_view("state_dict.").size()));
      return found == shards.named.end() ? at::Tensor() : rows(*found->second, key);
    }
    // optimizer_states.<optimizer>.state.<parameter index>.<name>; "step" is not per element.
    int64_t optimizer = -1, index = -1;
    int consumed = 0;
    if (std::sscanf(key.c_str(), "optimizer_states.%ld.state.%ld.%n", &optimizer, &index, &consumed) != 2 ||
        consumed == 0 || key.substr(consumed) == "step" || optimizer < 0 ||
        optimizer >= static_cast<int64_t>(shards.optimizers.size()))
      return {};
    const auto& order = shards.by_optimizer.at(shards.optimizers[optimizer]);
    return index >= 0 && index < static_cast<int64_t>(order.size()) ? rows(*order[index], key) : at::Tensor();
  });
  if (log::enabled(log::Level::debug))
    log::debug(fmt::format("strategy 'fsdp': rank {} read its rows of {} tensors from {}: {} of {} bytes", rank, sliced,
                           path, row_bytes, whole_bytes));
  split_checkpoint(whole, out, path);
  if (out.optimizer_states)
    for (c10::IValue& state : *out.optimizer_states) state = dcp::with_index_keys(state);
}

bool holds_rows(const c10::IValue& state, const Shards& shards) {
  if (!state.isGenericDict()) return false;
  const auto dict = state.toGenericDict();
  for (const auto& [name, p] : shards.named) {
    auto found = dict.find(name);
    if (found != dict.end() && found->value().isTensor() && p->is_local_rows(found->value().toTensor())) return true;
  }
  return false;
}

void load_module_rows(torch::nn::Module& module, const c10::IValue& state, bool strict, const std::string& origin,
                      const Shards& shards, int64_t rank) {
  const auto dict = state.toGenericDict();
  auto buffers = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> known;
  for (const auto& item : module.named_buffers()) known.insert(item.key());
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : shards.named) {
    known.insert(name);
    auto found = dict.find(name);
    if (found == dict.end() || !found->value().isTensor()) {
      missing.push_back(name);
      continue;
    }
    const at::Tensor t = found->value().toTensor();
    if (p->is_local_rows(t))
      p->shard.copy_(t);
    else if (t.sizes() == p->full.sizes())
      p->shard.copy_(p->rows_of(t.to(p->shard.device()), p->begin, p->local_rows()).reshape(p->shard_shape()));
    else
      mismatched.push_back(fmt::format("{} (checkpoint {}, model {} of which rank {} holds rows {}..{})", name,
                                       c10::str(t.sizes()), c10::str(p->full.sizes()), rank, p->begin, p->end));
  }
  for (const auto& entry : dict) {
    const std::string name = entry.key().isString() ? entry.key().toStringRef() : std::string();
    if (!known.contains(name))
      unexpected.push_back(name);
    else if (!shards.named.contains(name))
      buffers.insert(entry.key(), entry.value());
  }
  if (!strict) missing.clear(), unexpected.clear();
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty())
    throw Error(
        ErrorKind::checkpoint,
        fmt::format("checkpoint {}: the model state does not fit the model: missing [{}], unexpected [{}], "
                    "mis-shaped [{}]",
                    origin, fmt::join(missing, ", "), fmt::join(unexpected, ", "), fmt::join(mismatched, ", ")));
  load_module_state_dict(module, buffers, /*strict=*/false, origin);
}

}  // namespace fulgur::fsdp
