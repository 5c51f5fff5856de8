// GptModel: the layers, the steps, AdamW with weight-decay groups and the learning-rate schedule.
#include "gpt.h"

#include <fulgur/blocks.h>
#include <fulgur/communicator.h>
#include <fulgur/error.h>
#include <fulgur/nn/linear.h>
#include <fulgur/nn/tensor_parallel.h>
#include <fulgur/optim/lion.h>
#include <fulgur/optim/muon.h>
#include <fulgur/suggest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>

namespace fulgur::examples {

namespace nn = torch::nn;
namespace F = torch::nn::functional;
namespace tp = fulgur::nn;

namespace {

// A tensor-parallel group and this rank's place in it (model_parallel's mesh.group("tp")).
// With sequence_parallel the activations between the blocks are split along the sequence (dim 1 of
// [batch, sequence, channels]) across the group.
struct TensorParallel {
  std::shared_ptr<Communicator> group;
  int64_t rank = 0, size = 1;
  bool sequence_parallel = false;
};

constexpr int64_t kSequenceDim = 1;  // activations are [batch, sequence, channels]

// The whole input of the column-parallel layers that follow: replicated already (the identity, an
// all-reduce of its gradient in backward) or, under sequence parallelism, all-gathered along the
// sequence (a reduce-scatter in backward). The gathered tensor is a transposed view of the
// gather's buffer: made contiguous once here, or each Linear would save a contiguous copy of its
// own next to the buffer.
at::Tensor enter_tensor_parallel(const at::Tensor& x, const TensorParallel& tp) {
  if (!tp.sequence_parallel) return tp::copy_to_tensor_parallel(x, tp.group.get());
  return tp::gather_from_sequence_parallel(x, tp.group.get(), kSequenceDim).contiguous();
}

// Options of a split Linear: under sequence parallelism a row-parallel layer reduce-scatters its
// output along the sequence. (The column-parallel layers' weights are applied to the input that
// enter_tensor_parallel made whole once for all of them, not through their forward.)
tp::ParallelLinearOptions parallel_options(int64_t in, int64_t out, const TensorParallel& tp) {
  return tp::ParallelLinearOptions(in, out)
      .group(tp.group)
      .sequence_parallel(tp.sequence_parallel)
      .sequence_dim(kSequenceDim);
}

// A LayerNorm whose gain and bias are replicated across the group: under sequence parallelism each
// rank normalizes its part of the sequence, and replicated_parameter sums the partial gradients.
at::Tensor layer_norm(nn::LayerNorm& norm, const at::Tensor& x, const TensorParallel& tp) {
  if (!tp.sequence_parallel) return norm->forward(x);
  Communicator* group = tp.group.get();
  return torch::layer_norm(x, norm->options.normalized_shape(), tp::replicated_parameter(norm->weight, group),
                           tp::replicated_parameter(norm->bias, group), norm->options.eps());
}

// Dropout under tensor parallelism (Megatron's RNG tracker, fulgur::nn::TensorParallelRng): in a
// sharded region (this rank's heads; under sequence parallelism its part of the sequence) each
// rank draws its own mask, as one process's dropout over the whole tensor would; replicated
// regions draw from the default generator, which stays in step on every rank of the group. The
// sharded stream's seed is drawn from the default generator on entry (the same on every rank): an
// activation-checkpointing recomputation starts from the same state and so draws the same masks.
template <class Fn>
at::Tensor in_sharded_region(const TensorParallel& tp, bool draws, const at::Tensor& like, Fn&& fn) {
  if (tp.size == 1 || !draws) return fn();
  const auto seed = static_cast<uint64_t>(
      at::randint(std::numeric_limits<int64_t>::max(), {1}, at::TensorOptions().dtype(at::kLong)).item<int64_t>());
  tp::TensorParallelRng rng(seed, tp.rank, like.device());
  const auto sharded = rng.fork();
  return fn();
}

// `to` (a split layer's parameter) takes `from` (this rank's part of the whole layer's).
void assign(at::Tensor& to, const at::Tensor& from) {
  torch::NoGradGuard no_grad;
  to.copy_(from);
}

// The split layers draw whole weights when they are made; the whole layers' values are copied in
// instead, and the default generator is put back so the draws after them are one process's.
class KeepDefaultGenerator {
 public:
  KeepDefaultGenerator() : generator_(at::detail::getDefaultCPUGenerator()), state_(generator_.get_state()) {}
  ~KeepDefaultGenerator() { generator_.set_state(state_); }
  KeepDefaultGenerator(const KeepDefaultGenerator&) = delete;
  KeepDefaultGenerator& operator=(const KeepDefaultGenerator&) = delete;

 private:
  at::Generator generator_;
  at::Tensor state_;
};

// Column-parallel copy of rows [first, first + count) of a whole Linear (chunk `rank` of them).
tp::ColumnParallelLinear column_of(const fulgur::nn::Linear& whole, int64_t first, int64_t count,
                                   const TensorParallel& tp) {
  tp::ColumnParallelLinear layer(parallel_options(whole->weight.size(1), count, tp));
  assign(layer->weight, whole->weight.narrow(0, first, count).chunk(tp.size, 0)[tp.rank]);
  assign(layer->bias, whole->bias.narrow(0, first, count).chunk(tp.size, 0)[tp.rank]);
  return layer;
}

// Row-parallel copy of a whole Linear: chunk `rank` of its input columns, the whole bias.
tp::RowParallelLinear row_of(const fulgur::nn::Linear& whole, const TensorParallel& tp) {
  tp::RowParallelLinear layer(parallel_options(whole->weight.size(1), whole->weight.size(0), tp));
  assign(layer->weight, whole->weight.chunk(tp.size, 1)[tp.rank]);
  assign(layer->bias, whole->bias);
  return layer;
}

// Multi-head self-attention where position t sees positions <= t only (the causal mask of
// scaled_dot_product_attention, which also picks the fused CPU kernel).
//
// q, k and v are three layers, `attn.q`, `attn.k` and `attn.v`, in one process as under tensor
// parallelism (where each is column-parallel): a checkpoint has one set of names whatever strategy
// wrote it, so one trained under ddp resumes under model_parallel and the reverse, and exports
// (`fulgur weights`, safetensors) name the same tensors. They are drawn as one whole [3C, C] layer
// and cut into rows, so the initial values are those of a fused qkv.
class CausalSelfAttentionImpl : public nn::Module {
 public:
  CausalSelfAttentionImpl(int64_t n_embd, int64_t n_head, double dropout) : n_head_(n_head), dropout_(dropout) {
    qkv = register_module("qkv", fulgur::nn::Linear(n_embd, 3 * n_embd));
    proj = register_module("proj", fulgur::nn::Linear(n_embd, n_embd));
    resid_drop = register_module("resid_drop", nn::Dropout(dropout));
  }

  // After the whole layers are drawn: q, k and v from the rows of qkv. In one process they are
  // plain Linears; under tensor parallelism as Megatron splits attention: each rank computes
  // n_head / tp heads, q, k and v column-parallel (its heads' rows), the output projection
  // row-parallel (its heads' columns), whose all-reduce makes the output whole.
  void split(const TensorParallel& tp) {
    KeepDefaultGenerator keep;
    const int64_t C = proj->weight.size(0);
    const fulgur::nn::Linear whole_qkv = qkv;
    unregister_module("qkv");
    qkv = nullptr;
    if (tp.size == 1) {
      auto rows = [&](int64_t first) {
        fulgur::nn::Linear layer(C, C);
        assign(layer->weight, whole_qkv->weight.narrow(0, first, C));
        assign(layer->bias, whole_qkv->bias.narrow(0, first, C));
        return layer;
      };
      // Registered after the rest, as under tensor parallelism: the same parameter order.
      const fulgur::nn::Linear whole_proj = proj;
      unregister_module("proj");
      q = register_module("q", rows(0));
      k = register_module("k", rows(C));
      v = register_module("v", rows(2 * C));
      proj = register_module("proj", whole_proj);
      return;
    }
    const fulgur::nn::Linear whole_proj = proj;
    unregister_module("proj");
    proj = nullptr;
    q_tp = register_module("q", column_of(whole_qkv, 0, C, tp));
    k_tp = register_module("k", column_of(whole_qkv, C, C, tp));
    v_tp = register_module("v", column_of(whole_qkv, 2 * C, C, tp));
    proj_tp = register_module("proj", row_of(whole_proj, tp));
    local_heads_ = n_head_ / tp.size;
    tp_ = tp;
  }

  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), C = x.size(2);
    if (q_tp) {  // split: this rank's heads
      // One entry into the tensor-parallel region for q, k and v rather than one in each
      // column-parallel layer: an all-reduce of their summed input gradient in backward, or, under
      // sequence parallelism, an all-gather of the sequence (a reduce-scatter in backward).
      const at::Tensor whole = enter_tensor_parallel(x, tp_);
      const int64_t T = whole.size(1), head = C / n_head_;
      auto heads = [&](const tp::ColumnParallelLinear& part) {
        return at::linear(whole, part->weight, part->bias).view({B, T, local_heads_, head}).transpose(1, 2);
      };
      const bool drops = is_training() && dropout_ > 0;
      // This rank's heads: a sharded region.
      const at::Tensor y = in_sharded_region(tp_, drops, whole, [&] {
        return at::scaled_dot_product_attention(heads(q_tp), heads(k_tp), heads(v_tp), /*attn_mask=*/{},
                                                drops ? dropout_ : 0.0,
                                                /*is_causal=*/true);
      });
      // Row-parallel: the all-reduce (or reduce-scatter along the sequence) of the heads' outputs,
      // replicated (or this rank's part of the sequence: sharded).
      const at::Tensor out = proj_tp->forward(y.transpose(1, 2).reshape({B, T, local_heads_ * head}));
      return in_sharded_region(tp_, drops && tp_.sequence_parallel, out, [&] { return resid_drop->forward(out); });
    }
    if (!q) throw Error(ErrorKind::runtime, "CausalSelfAttention::forward before split(), which makes q, k and v");
    const int64_t T = x.size(1);
    // [B, T, C] -> [B, heads, T, C / heads] each
    auto heads = [&](fulgur::nn::Linear& part) {
      return part->forward(x).view({B, T, n_head_, C / n_head_}).transpose(1, 2);
    };
    at::Tensor y = at::scaled_dot_product_attention(heads(q), heads(k), heads(v), /*attn_mask=*/{},
                                                    is_training() ? dropout_ : 0.0, /*is_causal=*/true);
    y = y.transpose(1, 2).reshape({B, T, C});
    return resid_drop->forward(proj->forward(y));
  }

  // fulgur::nn::Linear: torch::nn::Linear's layer, which the fp8 precision can train in FP8 and
  // `fulgur quantize` can store as int8/int4. qkv exists only until split().
  fulgur::nn::Linear qkv{nullptr}, q{nullptr}, k{nullptr}, v{nullptr}, proj{nullptr};
  tp::ColumnParallelLinear q_tp{nullptr}, k_tp{nullptr}, v_tp{nullptr};  // tensor-parallel only
  tp::RowParallelLinear proj_tp{nullptr};                                // tensor-parallel only
  nn::Dropout resid_drop{nullptr};

 private:
  int64_t n_head_;
  int64_t local_heads_ = 0;
  double dropout_;
  TensorParallel tp_;  // tensor-parallel only
};
TORCH_MODULE(CausalSelfAttention);

// Pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x)) (GPT-2's arrangement; trains stably
// without a warm-up-sensitive final-LN-only setup).
class BlockImpl : public nn::Module {
 public:
  BlockImpl(int64_t n_embd, int64_t n_head, double dropout) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({n_embd})));
    attn = register_module("attn", CausalSelfAttention(n_embd, n_head, dropout));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({n_embd})));
    fc = register_module("fc", fulgur::nn::Linear(n_embd, 4 * n_embd));
    proj = register_module("proj", fulgur::nn::Linear(4 * n_embd, n_embd));
    drop = register_module("drop", nn::Dropout(dropout));
  }

  // Tensor parallelism: attention split by heads, the MLP's fc column-parallel and proj
  // row-parallel (Megatron's MLP: one all-reduce); LayerNorms stay whole on every rank. In one
  // process only attention's qkv is cut into q, k and v.
  void split(const TensorParallel& tp) {
    attn->split(tp);
    if (tp.size == 1) return;
    KeepDefaultGenerator keep;
    const fulgur::nn::Linear whole_fc = fc, whole_proj = proj;
    unregister_module("fc");
    unregister_module("proj");
    fc = nullptr;
    proj = nullptr;
    fc_tp = register_module("fc", column_of(whole_fc, 0, whole_fc->weight.size(0), tp));
    proj_tp = register_module("proj", row_of(whole_proj, tp));
    tp_ = tp;
  }

  // Under sequence parallelism x is this rank's part of the sequence, and so is the output.
  at::Tensor forward(at::Tensor x) {
    x = x + attn->forward(layer_norm(ln1, x, tp_));
    const at::Tensor h = layer_norm(ln2, x, tp_);
    if (fc_tp) {  // column-parallel fc from the whole input, row-parallel proj
      const at::Tensor up = at::linear(enter_tensor_parallel(h, tp_), fc_tp->weight, fc_tp->bias);
      const at::Tensor out = proj_tp->forward(torch::gelu(up, "tanh"));
      // Replicated, or under sequence parallelism this rank's part of the sequence: sharded.
      const bool drops = is_training() && drop->options.p() > 0 && tp_.sequence_parallel;
      return x + in_sharded_region(tp_, drops, out, [&] { return drop->forward(out); });
    }
    return x + drop->forward(proj->forward(torch::gelu(fc->forward(h), "tanh")));
  }

  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  fulgur::nn::Linear fc{nullptr}, proj{nullptr};
  tp::ColumnParallelLinear fc_tp{nullptr};  // split only
  tp::RowParallelLinear proj_tp{nullptr};   // split only
  nn::Dropout drop{nullptr};

 private:
  TensorParallel tp_;  // split only
};
TORCH_MODULE(Block);

[[noreturn]] void bad(const Options& hp, const std::string& what) {
  throw Error(ErrorKind::config, fmt::format("{}: {}", hp.owner(), what));
}

}  // namespace

struct GptModel::Layers {
  nn::Embedding tok_emb{nullptr}, pos_emb{nullptr};
  nn::Dropout drop{nullptr};
  std::vector<Block> blocks;
  nn::LayerNorm ln_f{nullptr};
  TensorParallel tp;  // from model_parallel's device mesh; one rank otherwise
};

GptModel::GptModel(const Options& given) : layers_(std::make_unique<Layers>()) {
  hparams = with_defaults(given, kGptModelHyperParams, "[model]");
  const Options& hp = hparams;
  block_size_ = hp.get_int("block_size");
  const int64_t n_layer = hp.get_int("n_layer"), n_head = hp.get_int("n_head"), n_embd = hp.get_int("n_embd");
  const double dropout = hp.get_float("dropout");
  if (block_size_ <= 0) bad(hp, fmt::format("block_size = {} must be positive", block_size_));
  if (n_layer <= 0) bad(hp, fmt::format("n_layer = {} must be positive", n_layer));
  if (n_head <= 0 || n_embd <= 0 || n_embd % n_head != 0)
    bad(hp, fmt::format("n_embd = {} must be a positive multiple of n_head = {} (each head gets n_embd / n_head)",
                        n_embd, n_head));
  if (!(dropout >= 0 && dropout < 1)) bad(hp, fmt::format("dropout = {} must be in [0, 1)", dropout));
  const double lr = hp.get_float("lr"), min_lr = hp.get_float("min_lr");
  if (!(lr > 0)) bad(hp, fmt::format("lr = {} must be positive", lr));
  if (!(min_lr >= 0 && min_lr <= lr)) bad(hp, fmt::format("min_lr = {} must be in [0, lr = {}]", min_lr, lr));
  if (!(hp.get_float("weight_decay") >= 0))
    bad(hp, fmt::format("weight_decay = {} must be >= 0", hp.get_float("weight_decay")));
  const std::string& optimizer = hp.get_string("optimizer");
  if (optimizer != "adamw" && optimizer != "muon" && optimizer != "lion") {
    std::string suggestion = closest_match(optimizer, {"adamw", "muon", "lion"});
    bad(hp, fmt::format("unknown optimizer '{}'{}; choose \"adamw\", \"muon\" or \"lion\"", optimizer,
                        suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion)));
  }
  const std::vector<double>& betas = hp.get_float_list("betas");
  if (betas.size() != 2 || !(betas[0] >= 0 && betas[0] < 1) || !(betas[1] >= 0 && betas[1] < 1))
    bad(hp, "betas must be two numbers in [0, 1), e.g. [0.9, 0.99]");
  const int64_t warmup = hp.get_int("warmup_steps"), decay = hp.get_int("lr_decay_steps");
  if (decay <= 0 || warmup < 0 || warmup > decay)
    bad(hp, fmt::format("need 0 <= warmup_steps ({}) <= lr_decay_steps ({}), lr_decay_steps > 0", warmup, decay));
  if (hp.get_string("prompt").empty()) bad(hp, "prompt must not be empty: sampling starts from its tokens");
  if (hp.get_int("max_new_tokens") < 0)
    bad(hp, fmt::format("max_new_tokens = {} must be >= 0", hp.get_int("max_new_tokens")));
  if (!(hp.get_float("temperature") >= 0))
    bad(hp, fmt::format("temperature = {} must be >= 0 (0: greedy)", hp.get_float("temperature")));
  if (hp.get_int("top_k") < 0 || hp.get_int("top_k") > kByteVocabSize)
    bad(hp, fmt::format("top_k = {} must be in [0, {}] (0: no limit)", hp.get_int("top_k"), kByteVocabSize));
  if (hp.get_int("sample_seed") < 0) bad(hp, fmt::format("sample_seed = {} must be >= 0", hp.get_int("sample_seed")));
  (void)hp.get_bool("print_samples");  // type check now, not at the end of training
  checkpoint_activations_ = hp.get_bool("activation_checkpointing");

  val_ppl_.sync_with(*this);
}

GptModel::~GptModel() = default;

void GptModel::set_device_mesh(const DeviceMesh& mesh) {
  TensorParallel& tp = layers_->tp;
  tp.group = mesh.group("tp");
  tp.rank = mesh.local_rank("tp");
  tp.size = mesh.size("tp");
  tp.sequence_parallel = tp.size > 1 && hparams.get_bool("sequence_parallel");
  const int64_t n_head = hparams.get_int("n_head");
  if (tp.size > 1 && n_head % tp.size != 0)
    bad(hparams, fmt::format("n_head = {} must be a multiple of tensor_parallel_size = {} (each rank computes "
                             "n_head / tensor_parallel_size heads)",
                             n_head, tp.size));
  if (tp.size > 1 && hparams.get_string("optimizer") == "muon")
    bad(hparams,
        "optimizer = \"muon\" orthogonalizes whole matrices, and a tensor-parallel rank holds a shard of "
        "each: use \"adamw\" or \"lion\" with tensor_parallel_size > 1");
}

namespace {

// GPT-2's initialisation of one part of the model: N(0, 0.02) weights, zero biases, and the
// projections that write into the residual stream scaled by 1/sqrt(2 n_layer) so that its variance
// does not grow with depth.
void init_weights(nn::Module& part, int64_t n_layer) {
  torch::NoGradGuard no_grad;
  for (auto& p : part.named_parameters()) {
    if (p.key().ends_with("bias"))
      p.value().zero_();
    else if (p.value().dim() >= 2)
      p.value().normal_(0.0, p.key().ends_with("proj.weight") ? 0.02 / std::sqrt(2.0 * n_layer) : 0.02);
  }
}

}  // namespace

// The layers are made here rather than in the constructor so that a sharded strategy sees each
// transformer block as it is completed (fulgur::built_block): under fsdp zero_stage = 3 a rank
// then never holds more than its shards and one whole block. Each part is initialised as soon as
// it exists, so the random numbers are drawn in the same order under every strategy.
void GptModel::configure_model() {
  Layers& l = *layers_;
  if (l.tok_emb) return;        // built already: configure_model runs for every stage
  const Options& hp = hparams;  // checked by the constructor
  const int64_t n_layer = hp.get_int("n_layer"), n_head = hp.get_int("n_head"), n_embd = hp.get_int("n_embd");
  const double dropout = hp.get_float("dropout");
  l.tok_emb = register_module("tok_emb", nn::Embedding(kByteVocabSize, n_embd));
  init_weights(*l.tok_emb, n_layer);
  l.pos_emb = register_module("pos_emb", nn::Embedding(block_size_, n_embd));
  init_weights(*l.pos_emb, n_layer);
  l.drop = register_module("drop", nn::Dropout(dropout));
  nn::ModuleList blocks = register_module("blocks", nn::ModuleList());
  for (int64_t i = 0; i < n_layer; ++i) {
    Block block(n_embd, n_head, dropout);
    init_weights(*block, n_layer);
    // Split after the whole block is drawn: the split model starts as one process's (in one
    // process only qkv is cut, into q, k and v).
    block->split(l.tp);
    blocks->push_back(fulgur::built_block(block));
    l.blocks.push_back(block);
  }
  l.ln_f = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({n_embd})));
}

void GptModel::check_length(int64_t length) const {
  if (length > block_size_)
    throw Error(ErrorKind::config,
                fmt::format("{}: a sequence of {} tokens is longer than block_size = {}: set [data] block_size <= "
                            "[model] block_size",
                            hparams.owner(), length, block_size_));
}

at::Tensor GptModel::forward(const at::Tensor& given) {
  check_length(given.size(1));
  Layers& l = *layers_;
  if (!l.tok_emb) throw Error(ErrorKind::runtime, "GptModel::forward before configure_model(), which makes the layers");
  Communicator* group = l.tp.group.get();
  // Sequence parallelism splits the sequence into tensor_parallel_size equal parts: a shorter one
  // (a prompt while sampling) gets padding on the right, which causal attention keeps out of the
  // real positions' outputs; its logits are dropped at the end.
  const int64_t length = given.size(1);
  at::Tensor tokens = given;
  if (l.tp.sequence_parallel && length % l.tp.size != 0) {
    const int64_t padded = (length + l.tp.size - 1) / l.tp.size * l.tp.size;
    if (padded > block_size_)
      throw Error(ErrorKind::config,
                  fmt::format("{}: sequence_parallel splits each sequence across the {} tensor-parallel ranks, and "
                              "a sequence of {} tokens, padded to {}, is longer than block_size = {}: set [model] "
                              "block_size to a multiple of tensor_parallel_size, or sequence_parallel = false",
                              hparams.owner(), l.tp.size, length, padded, block_size_));
    tokens = at::constant_pad_nd(given, {0, padded - length}, 0);
  }
  const at::Tensor positions = torch::arange(tokens.size(1), tokens.options().dtype(torch::kLong));
  at::Tensor x = l.drop->forward(l.tok_emb->forward(tokens) + l.pos_emb->forward(positions));
  // Replicated embeddings -> this rank's part of the sequence (an all-gather in backward).
  if (l.tp.sequence_parallel) x = tp::scatter_to_sequence_parallel(x, group, kSequenceDim);
  // Each transformer block is a fulgur block: a unit that fsdp's ZeRO-3 gathers around its use,
  // and, with activation_checkpointing, recomputed in backward. Alone it is a plain call.
  const auto options = fulgur::BlockOptions().checkpoint_activations(checkpoint_activations_);
  for (Block& block : l.blocks) x = fulgur::run_block(block, x, options);
  // The whole sequence again for the final LayerNorm and the tied head; backward keeps this rank's
  // part of the gradient, which every rank computes whole.
  if (l.tp.sequence_parallel) x = tp::gather_from_tensor_parallel(x, group, kSequenceDim).narrow(1, 0, length);
  // Weight tying: the output layer is the token embedding (fewer parameters, and a better
  // language model at this size); no separate lm_head parameter exists.
  return at::linear(l.ln_f->forward(x), l.tok_emb->weight);
}

ParameterGroups GptModel::parameter_groups() const {
  ParameterGroups groups;
  // Only weights that multiply activations (Linear) decay; pulling embeddings or LayerNorm gains
  // towards zero would only fight the model.
  for (const auto& m : named_modules("", /*include_self=*/false)) {
    if (!m.value()->as<fulgur::nn::Linear>() && !m.value()->as<tp::ColumnParallelLinear>() &&
        !m.value()->as<tp::RowParallelLinear>())
      continue;
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) {
      if (p.key() != "weight") continue;
      groups.decay.push_back(p.value());
      groups.decay_names.push_back(m.key() + ".weight");
    }
  }
  for (const auto& p : named_parameters()) {
    if (std::find(groups.decay_names.begin(), groups.decay_names.end(), p.key()) != groups.decay_names.end()) continue;
    groups.no_decay.push_back(p.value());
    groups.no_decay_names.push_back(p.key());
  }
  return groups;
}

at::Tensor GptModel::loss_of(const at::Tensor& logits, const at::Tensor& target) const {
  // Under bf16 autocast the logits are bfloat16: the softmax runs in float32.
  return F::cross_entropy(logits.flatten(0, 1).to(torch::kFloat32), target.flatten());
}

StepOutput GptModel::training_step(const Batch& batch, int64_t) {
  const at::Tensor loss = loss_of(forward(batch.input), batch.target);
  log("train/loss", loss, LogOptions().prog_bar(true));
  return {loss};
}

StepOutput GptModel::validation_step(const Batch& batch, int64_t) {
  const at::Tensor logits = forward(batch.input);
  const at::Tensor loss = loss_of(logits, batch.target);
  // Mean over the epoch weighted by rows; every row has block_size tokens, so this is the mean
  // token loss, and val/ppl = exp(val/loss).
  log("val/loss", loss, LogOptions().prog_bar(true).sync_dist(true));
  val_ppl_.update(logits.to(torch::kFloat32), batch.target);
  log("val/ppl", val_ppl_, LogOptions().prog_bar(true));
  return {loss};
}

at::Tensor GptModel::generate(at::Tensor context, int64_t max_new_tokens, double temperature, int64_t top_k,
                              uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const int64_t t = context.size(1);
    const at::Tensor window = t > block_size_ ? context.narrow(1, t - block_size_, block_size_) : context;
    at::Tensor logits = forward(window).select(1, -1).to(torch::kFloat32).cpu();
    at::Tensor next;
    if (temperature == 0) {
      next = logits.argmax(-1, /*keepdim=*/true);
    } else {
      logits = logits / temperature;
      if (top_k > 0) {
        const at::Tensor kth = std::get<0>(logits.topk(top_k, -1)).select(-1, -1).unsqueeze(-1);
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = at::multinomial(logits.softmax(-1), 1, /*replacement=*/false, gen);
    }
    context = torch::cat({context, next.to(context.device())}, 1);
  }
  return context;
}

at::Tensor GptModel::predict_step(const Batch& batch, int64_t) {
  const Options& hp = hparams;
  const std::string prompt = hp.get_string("prompt");
  const int64_t rows = batch.size();
  const at::Tensor context = encode_bytes(prompt).to(batch.input.device()).unsqueeze(0).repeat({rows, 1});
  // Seeded by the batch's first row, so a row's text does not depend on how many ranks share it.
  const int64_t first_row = rows > 0 ? batch.input[0].item<int64_t>() : 0;
  const at::Tensor out = generate(context, hp.get_int("max_new_tokens"), hp.get_float("temperature"),
                                  hp.get_int("top_k"), static_cast<uint64_t>(hp.get_int("sample_seed") + first_row));
  if (hp.get_bool("print_samples")) {
    // The rows are sharded across ranks by the loader: each rank prints the rows it generated.
    for (int64_t r = 0; r < rows; ++r) {
      const std::string text = decode_bytes(out[r]);
      std::printf("--- sample %lld (%zu bytes) ---\n", static_cast<long long>(batch.input[r].item<int64_t>()),
                  text.size());
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
  return out;
}

std::vector<OptimizerConfig> GptModel::configure_optimizers() {
  const Options& hp = hparams;
  const std::vector<double>& betas = hp.get_float_list("betas");
  auto options = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(hp.get_float("lr")).betas({betas[0], betas[1]}).weight_decay(weight_decay));
  };
  ParameterGroups groups = parameter_groups();
  const std::string& kind = hp.get_string("optimizer");
  const double lr = hp.get_float("lr"), weight_decay = hp.get_float("weight_decay");
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  if (kind == "muon") {
    // The decaying group is exactly the blocks' Linear weights (the head is tied to tok_emb): the
    // hidden matrices Muon is for. Embeddings, biases and LayerNorm gains stay with AdamW.
    namespace fo = fulgur::optim;
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    param_groups.emplace_back(groups.decay,
                              std::make_unique<fo::MuonOptions>(
                                  fo::MuonOptions(lr).weight_decay(weight_decay).adjust_lr_fn("match_rms_adamw")));
    param_groups.emplace_back(groups.no_decay,
                              std::make_unique<fo::MuonOptions>(
                                  fo::MuonOptions(lr).use_muon(false).betas({betas[0], betas[1]}).weight_decay(0.0)));
    optimizer = std::make_shared<fo::Muon>(std::move(param_groups));
  } else if (kind == "lion") {
    namespace fo = fulgur::optim;
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    param_groups.emplace_back(
        groups.decay,
        std::make_unique<fo::LionOptions>(fo::LionOptions(lr).betas({betas[0], betas[1]}).weight_decay(weight_decay)));
    param_groups.emplace_back(groups.no_decay,
                              std::make_unique<fo::LionOptions>(fo::LionOptions(lr).betas({betas[0], betas[1]})));
    optimizer = std::make_shared<fo::Lion>(std::move(param_groups), fo::LionOptions(lr));
  } else {
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    param_groups.emplace_back(groups.decay, options(weight_decay));
    param_groups.emplace_back(groups.no_decay, options(0.0));
    optimizer = std::make_shared<torch::optim::AdamW>(std::move(param_groups), *options(0.0));
  }
  // make_cosine_with_warmup applies warmup_start_factor * lr at step 0 and reaches lr at
  // warmup_steps; starting at lr / warmup_steps rather than 0 keeps the first step useful.
  const int64_t warmup = hp.get_int("warmup_steps");
  auto scheduler = make_cosine_with_warmup(*optimizer, warmup, hp.get_int("lr_decay_steps"), hp.get_float("min_lr"),
                                           warmup > 0 ? 1.0 / static_cast<double>(warmup) : 1.0);
  return {OptimizerConfig(optimizer).with_scheduler(scheduler, SchedulerInterval::step)};
}

}  // namespace fulgur::examples
