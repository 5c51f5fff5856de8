#include "tp_checkpoint.h"

#include "../common/optimizer_state_map.h"

#include <fulgur/error.h>
#include <fulgur/nn/tensor_parallel.h>

#include <ATen/core/Dict.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <string_view>
#include <utility>

namespace fulgur::model_parallel {
namespace {

Piece split_piece(const at::Tensor& local, std::vector<int64_t> global_shape, std::vector<int64_t> offsets) {
  return Piece{true, std::move(global_shape), std::move(offsets), local.sizes().vec()};
}

const Piece* piece_of(const Pieces& pieces, const at::Tensor& parameter) {
  auto found = pieces.by_tensor.find(parameter.unsafeGetTensorImpl());
  return found == pieces.by_tensor.end() ? nullptr : &found->second;
}

// This rank's part of `local` (a parameter as this rank holds it, or a tensor of its optimizer
// state) in the FSDP2 + TP layout: its rows along dp inside the tensor-parallel shard, as
// fully_shard's torch.chunk gives them (ceil(rows / dp) each, the last ones possibly short or
// empty). Replicated tensors are written by tp rank 0 only. nullopt: nothing of it here.
std::optional<std::pair<at::Tensor, dcp::Chunk>> chunk_of(const at::Tensor& local, const Piece* piece,
                                                          const Coordinate& at) {
  const bool split = piece != nullptr && piece->split;
  if (!split && at.tp_rank != 0) return std::nullopt;
  const int64_t rows = local.size(0);
  const int64_t per = (rows + at.dp_size - 1) / at.dp_size;
  const int64_t begin = std::min(at.dp_rank * per, rows);
  const int64_t count = std::min(per, rows - begin);
  if (count <= 0) return std::nullopt;
  std::vector<int64_t> offsets = split ? piece->offsets : std::vector<int64_t>(local.dim(), 0);
  offsets[0] += begin;
  return std::make_pair(
      local.narrow(0, begin, count),
      dcp::Chunk().set_global_shape(split ? piece->global_shape : local.sizes().vec()).set_offsets(std::move(offsets)));
}

// `whole` cut to the shard `piece` describes; tensors that are not the whole tensor's shape pass.
at::Tensor cut(const at::Tensor& whole, const Piece* piece) {
  if (piece == nullptr || !piece->split || whole.sizes().vec() != piece->global_shape) return whole;
  at::Tensor part = whole;
  for (int64_t d = 0; d < whole.dim(); ++d) part = part.narrow(d, piece->offsets[d], piece->local_shape[d]);
  return part.clone();
}

// `state` in torch.optim's layout with every per-parameter tensor but "step" replaced by
// fn(stepped, piece, index, name, tensor) (nullopt leaves it out); 0-dim tensors are kept. A new
// dict (optimizer_state::map_parameter_states walks the layout).
template <class Fn>
c10::IValue map_parameter_states(const c10::IValue& state, const StepOrder& order, const Pieces& pieces, Fn&& fn) {
  return optimizer_state::map_parameter_states(
      state, static_cast<int64_t>(order.size()),
      [&](int64_t index, const std::string& name, const at::Tensor& tensor) -> std::optional<at::Tensor> {
        if (tensor.dim() == 0) return tensor;
        const Stepped& stepped = order[static_cast<size_t>(index)];
        return fn(stepped, piece_of(pieces, stepped.parameter), index, name, tensor);
      });
}

// "optimizer_states.<optimizer>.state.<index>.<name>" -> (optimizer, index); nullopt otherwise.
std::optional<std::pair<size_t, size_t>> optimizer_state_key(std::string_view key) {
  constexpr std::string_view prefix = "optimizer_states.";
  if (!key.starts_with(prefix)) return std::nullopt;
  key.remove_prefix(prefix.size());
  size_t optimizer = 0, index = 0;
  auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), optimizer);
  if (error != std::errc()) return std::nullopt;
  key.remove_prefix(static_cast<size_t>(end - key.data()));
  constexpr std::string_view state = ".state.";
  if (!key.starts_with(state)) return std::nullopt;
  key.remove_prefix(state.size());
  auto [end2, error2] = std::from_chars(key.data(), key.data() + key.size(), index);
  if (error2 != std::errc()) return std::nullopt;
  return std::make_pair(optimizer, index);
}

}  // namespace

std::vector<int64_t> Stepped::state_shape() const {
  std::vector<int64_t> shape = parameter.sizes().vec();
  if (rows() && !shape.empty()) shape[0] = count;
  return shape;
}

StepOrder whole_order(torch::optim::Optimizer& optimizer) {
  StepOrder order;
  for (auto& group : optimizer.param_groups())
    for (const at::Tensor& p : group.params()) order.push_back(Stepped{p});
  return order;
}

Pieces find_pieces(torch::nn::Module& model, int64_t tp_rank) {
  Pieces pieces;
  auto add = [&](const at::Tensor& t, Piece piece) {
    if (t.defined()) pieces.by_tensor[t.unsafeGetTensorImpl()] = std::move(piece);
  };
  // The root apart: named_modules' include_self needs a module held by a shared_ptr, which a
  // caller's stack-held model (the testing kit's) is not.
  std::vector<torch::nn::Module*> modules{&model};
  for (const auto& item : model.named_modules("", /*include_self=*/false)) modules.push_back(item.value().get());
  for (torch::nn::Module* m : modules) {
    if (auto* column = dynamic_cast<fulgur::nn::ColumnParallelLinearImpl*>(m)) {
      const int64_t out = column->options.out_features();
      const int64_t rows = column->weight.size(0);
      if (rows == out) continue;  // one rank: whole
      add(column->weight, split_piece(column->weight, {out, column->options.in_features()}, {tp_rank * rows, 0}));
      if (column->bias.defined()) add(column->bias, split_piece(column->bias, {out}, {tp_rank * rows}));
    } else if (auto* row = dynamic_cast<fulgur::nn::RowParallelLinearImpl*>(m)) {
      const int64_t in = row->options.in_features();
      const int64_t columns = row->weight.size(1);
      if (columns == in) continue;
      add(row->weight, split_piece(row->weight, {row->options.out_features(), in}, {0, tp_rank * columns}));
    } else if (auto* embedding = dynamic_cast<fulgur::nn::VocabParallelEmbeddingImpl*>(m)) {
      const int64_t vocab = embedding->options.num_embeddings();
      if (embedding->weight.size(0) == vocab) continue;
      add(embedding->weight,
          split_piece(embedding->weight, {vocab, embedding->options.embedding_dim()}, {embedding->vocab_start, 0}));
    }
  }
  for (const auto& item : model.named_parameters()) {
    pieces.parameters.insert(item.key());
    auto found = pieces.by_tensor.find(item.value().unsafeGetTensorImpl());
    if (found == pieces.by_tensor.end()) continue;
    pieces.by_name[item.key()] = &found->second;
    pieces.split_names.push_back(item.key());
  }
  return pieces;
}

c10::IValue sharded_module_state(const c10::IValue& state, const Pieces& pieces, const Coordinate& at,
                                 std::map<std::string, dcp::Chunk>& placements) {
  placements.clear();
  if (!state.isGenericDict()) return state;
  const auto entries = state.toGenericDict();
  auto out = c10::impl::GenericDict(entries.keyType(), entries.valueType());
  for (const auto& entry : entries) {
    const std::string name = entry.key().isString() ? entry.key().toStringRef() : std::string();
    // Buffers, scalars and anything else: whole, written by rank 0.
    if (!entry.value().isTensor() || entry.value().toTensor().dim() == 0 || !pieces.parameters.contains(name)) {
      out.insert(entry.key(), entry.value());
      continue;
    }
    const at::Tensor& value = entry.value().toTensor();
    auto found = pieces.by_name.find(name);
    if (auto part = chunk_of(value, found == pieces.by_name.end() ? nullptr : found->second, at)) {
      out.insert(entry.key(), part->first);
      placements["state_dict." + name] = std::move(part->second);
    }
  }
  return out;
}

c10::IValue sharded_optimizer_state(const c10::IValue& local, const StepOrder& order, int64_t optimizer_index,
                                    const Pieces& pieces, const Coordinate& at,
                                    std::map<std::string, dcp::Chunk>& placements) {
  return map_parameter_states(
      local, order, pieces,
      [&](const Stepped& stepped, const Piece* piece, int64_t index, const std::string& name,
          const at::Tensor& t) -> std::optional<at::Tensor> {
        // Not of the parameter's shape, so not per element: replicated, rank 0 writes it whole.
        if (t.sizes().vec() != stepped.state_shape()) return t;
        const std::string key = fmt::format("optimizer_states.{}.state.{}.{}", optimizer_index, index, name);
        if (!stepped.rows()) {
          auto part = chunk_of(t, piece, at);
          if (!part) return std::nullopt;
          placements[key] = std::move(part->second);
          return part->first;
        }
        // Sharded over dp: this rank's rows already, the same rows chunk_of would cut.
        const bool split = piece != nullptr && piece->split;
        if ((!split && at.tp_rank != 0) || stepped.count == 0) return std::nullopt;
        std::vector<int64_t> offsets = split ? piece->offsets : std::vector<int64_t>(t.dim(), 0);
        offsets[0] += stepped.begin;
        placements[key] = dcp::Chunk()
                              .set_global_shape(split ? piece->global_shape : stepped.parameter.sizes().vec())
                              .set_offsets(std::move(offsets));
        return t;
      });
}

c10::IValue local_module_state(const c10::IValue& state, const Pieces& pieces) {
  if (!state.isGenericDict()) return state;
  const auto entries = state.toGenericDict();
  auto out = c10::impl::GenericDict(entries.keyType(), entries.valueType());
  for (const auto& entry : entries) {
    const Piece* piece = nullptr;
    if (entry.key().isString())
      if (auto found = pieces.by_name.find(entry.key().toStringRef()); found != pieces.by_name.end())
        piece = found->second;
    out.insert(entry.key(),
               entry.value().isTensor() ? c10::IValue(cut(entry.value().toTensor(), piece)) : entry.value());
  }
  return out;
}

at::Tensor local_state_tensor(const at::Tensor& tensor, const Pieces& pieces, const at::Tensor& parameter) {
  return cut(tensor, piece_of(pieces, parameter));
}

c10::IValue local_optimizer_state(const c10::IValue& state, const StepOrder& order, const Pieces& pieces) {
  return map_parameter_states(state, order, pieces,
                              [](const Stepped& stepped, const Piece* piece, int64_t, const std::string&,
                                 const at::Tensor& t) -> std::optional<at::Tensor> {
                                at::Tensor local = cut(t, piece);
                                // Whole along dp (a checkpoint of any layout, read whole): this rank's rows.
                                if (stepped.rows() && local.dim() > 0 && local.sizes() == stepped.parameter.sizes())
                                  return local.narrow(0, stepped.begin, stepped.count).clone();
                                return local;
                              });
}

c10::IValue read_local(const std::string& path, const Pieces& pieces, const std::vector<StepOrder>& orders) {
  const dcp::Reader reader(path);
  return reader.read_all([&](const std::string& key) -> at::Tensor {
    const Piece* piece = nullptr;
    const Stepped* stepped = nullptr;
    if (key.starts_with("state_dict.")) {
      if (auto found = pieces.by_name.find(key.substr(std::string_view("state_dict.").size()));
          found != pieces.by_name.end())
        piece = found->second;
    } else if (auto at = optimizer_state_key(key);
               at && at->first < orders.size() && at->second < orders[at->first].size()) {
      stepped = &orders[at->first][at->second];
      piece = piece_of(pieces, stepped->parameter);
    }
    const bool split = piece != nullptr && piece->split;
    if (stepped != nullptr && stepped->rows() && stepped->count > 0 && stepped->parameter.dim() > 0) {
      // Sharded over dp: only this rank's rows of its tp shard (or of the replicated tensor).
      std::vector<int64_t> global = split ? piece->global_shape : stepped->parameter.sizes().vec();
      if (reader.shape(key) != global) return {};
      std::vector<int64_t> offsets = split ? piece->offsets : std::vector<int64_t>(global.size(), 0);
      offsets[0] += stepped->begin;
      return reader.read(key, offsets, stepped->state_shape());
    }
    // Not split, or not the whole tensor's shape (the loaders judge it): read whole.
    if (!split || reader.shape(key) != piece->global_shape) return {};
    return reader.read(key, piece->offsets, piece->local_shape);
  });
}

}  // namespace fulgur::model_parallel
