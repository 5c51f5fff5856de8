// A small GPT trained on bytes of text, for Fulgur: the second example next to Fashion-MNIST.
//
//   GptModel              : fulgur::Module      [model] table: decoder-only transformer (pre-LN
//                                               causal self-attention blocks, tied embeddings),
//                                               AdamW with weight-decay groups, linear warm-up +
//                                               cosine decay, sampling in predict_step
//   CharCorpusDataModule  : fulgur::DataModule  [data] table: a text corpus as byte tokens in
//                                               memory-mapped token files written once
//
// Both read every hyperparameter from the Options they are built with; the tables below list
// each key with its type, default (TOML text) and help: they are the classes' hparams_schema, so
// the plugins `gpt` and `char_corpus` (gpt_plugins.cpp) have them as their schemas and `fulgur fit`
// checks [model] / [data] against them. Built directly, a key not in the table is refused with a
// suggestion, a value of the wrong type by Options.
//
// The header stays cheap to include (no <torch/torch.h>; the layers live in gpt_model.cpp).
#pragma once

#include <fulgur/data.h>
#include <fulgur/metrics.h>
#include <fulgur/model_parallel.h>
#include <fulgur/module.h>
#include <fulgur/option_spec.h>
#include <fulgur/options.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace torch::optim {
class AdamW;
}

namespace fulgur::examples {

// Byte-level tokens: every byte value is a token, so any text (UTF-8 included) round-trips and
// no vocabulary file has to travel with a checkpoint.
inline constexpr int64_t kByteVocabSize = 256;

// Where the Debian package `fortunes` (with `fortunes-min`) installs its cookie files: about
// 2.6 MB of plain English text in ~50 files, quotes separated by "%" lines.
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";
inline constexpr const char* kFortunesPackageHint =
    "install the Debian package fortunes (apt-get install fortunes), or set [data] corpus to a text file or a "
    "directory of text files";

// One hyperparameter: fulgur::OptionSpec, so that the tables below are the classes' hparams_schema
// (the `gpt` and `char_corpus` plugins' schemas, checked by `fulgur fit`).
using HyperParam = OptionSpec;

// clang-format off
inline constexpr std::array<HyperParam, 20> kGptModelHyperParams{{
  {OptionType::integer,    "block_size",     "Context length in tokens (positions the model knows); >= [data] block_size", "64"},
  {OptionType::integer,    "n_layer",        "Transformer blocks", "4"},
  {OptionType::integer,    "n_head",         "Attention heads per block; must divide n_embd", "4"},
  {OptionType::integer,    "n_embd",         "Width of the residual stream", "64"},
  {OptionType::floating,   "dropout",        "Dropout on embeddings, attention weights and residual branches, in [0, 1)", "0.0"},
  {OptionType::boolean,    "activation_checkpointing", "Recompute each transformer block's activations in backward instead of keeping them; the blocks run through fulgur::run_block either way, the units fsdp zero_stage = 3 shards", "false"},
  {OptionType::boolean,    "sequence_parallel", "Under model_parallel with tensor_parallel_size > 1: split the activations between the blocks (LayerNorms, residual stream) along the sequence across the tensor-parallel ranks (Megatron's sequence parallelism: an all-gather and a reduce-scatter per attention and MLP instead of an all-reduce); the sequence length must divide by tensor_parallel_size", "false"},
  {OptionType::string,     "optimizer",      "\"adamw\"; \"muon\" (fulgur::optim::Muon on the blocks' Linear weights with match_rms_adamw, so AdamW's lr fits; AdamW on embeddings, biases, LayerNorms); \"lion\" (give it a 3-10x smaller lr)", "\"adamw\""},
  {OptionType::floating,   "lr",             "Peak learning rate of AdamW (reached after warmup_steps)", "3e-3"},
  {OptionType::floating,   "min_lr",         "Learning rate at the end of the cosine decay and after it", "3e-4"},
  {OptionType::floating,   "weight_decay",   "AdamW decoupled weight decay of the Linear weights; biases, LayerNorm and embeddings get none", "0.1"},
  {OptionType::float_list, "betas",          "AdamW (beta1, beta2)", "[0.9, 0.99]"},
  {OptionType::integer,    "warmup_steps",   "Optimizer steps of linear warm-up from lr / warmup_steps to lr", "50"},
  {OptionType::integer,    "lr_decay_steps", "Optimizer step at which the cosine decay reaches min_lr (usually [trainer] max_steps)", "1000"},
  {OptionType::string,     "prompt",         "predict: text every sample starts from", "\"%\\n\""},
  {OptionType::integer,    "max_new_tokens", "predict: tokens generated after the prompt", "200"},
  {OptionType::floating,   "temperature",    "predict: logits are divided by it; 0 = greedy (argmax)", "0.8"},
  {OptionType::integer,    "top_k",          "predict: sample among the k most likely tokens; 0 = all", "40"},
  {OptionType::integer,    "sample_seed",    "predict: seed of the sampling generator (batch b uses sample_seed + its first row)", "1234"},
  {OptionType::boolean,    "print_samples",  "predict: print each decoded sample to stdout (rows sharded across ranks)", "true"},
}};

inline constexpr std::array<HyperParam, 9> kCharCorpusHyperParams{{
  {OptionType::string,  "corpus",          "A text file, or a directory whose regular files (except *.dat indexes) are read in name order", "\"/usr/share/games/fortunes\""},
  {OptionType::string,  "cache_dir",       "Where the token files are written once and reused; \"\" = $XDG_CACHE_HOME/fulgur/gpt (~/.cache/fulgur/gpt)", "\"\""},
  {OptionType::integer, "max_bytes",       "Use only the first max_bytes bytes of the corpus; 0 = all", "0"},
  {OptionType::floating,"val_fraction",    "Fraction of the corpus (in 8 KiB chunks spread evenly) held out for validation; 0 = none", "0.1"},
  {OptionType::integer, "block_size",      "Tokens per training window (the target is the window shifted by one)", "64"},
  {OptionType::integer, "batch_size",      "Windows per batch", "32"},
  {OptionType::integer, "num_workers",     "Threads assembling batches next to the training step (0: in the step's thread)", "0"},
  {OptionType::integer, "seed",            "Seeds the order of the random training windows", "42"},
  {OptionType::integer, "predict_samples", "Samples predict generates (one row each, one batch)", "4"},
}};
// clang-format on

// Bytes of text <-> token ids (int64 tensors).
at::Tensor encode_bytes(std::string_view text);
std::string decode_bytes(const at::Tensor& tokens);

// Parameters split for AdamW: `decay` gets weight decay (the Linear weights), `no_decay` none
// (biases, LayerNorm weights, token and position embeddings), each with its dotted name.
struct ParameterGroups {
  std::vector<at::Tensor> decay, no_decay;
  std::vector<std::string> decay_names, no_decay_names;
};

// Under the model_parallel strategy (fulgur::DeviceMeshReceiver) each transformer block is split
// across mesh.group("tp"): attention by heads, the MLP Megatron's way; embeddings, LayerNorms and
// the tied output layer stay whole on every rank.
class GptModel : public Module, public DeviceMeshReceiver {
 public:
  static constexpr auto hparams_schema = kGptModelHyperParams;
  explicit GptModel(const Options& hparams);
  ~GptModel() override;

  // model_parallel's mesh, before configure_model: the blocks are split across its "tp" group.
  void set_device_mesh(const DeviceMesh& mesh) override;

  // Makes and initialises the layers (once; the Trainer calls it for every stage).
  void configure_model() override;
  // Logits [B, T, vocab] for token ids [B, T], T <= block_size.
  at::Tensor forward(const at::Tensor& tokens);
  // Appends `max_new_tokens` sampled tokens to each row of `context` [B, T0]; returns [B, T0 + n].
  // temperature 0 picks the most likely token; top_k > 0 samples among the k most likely.
  at::Tensor generate(at::Tensor context, int64_t max_new_tokens, double temperature, int64_t top_k, uint64_t seed);
  ParameterGroups parameter_groups() const;

  StepOutput training_step(const Batch& batch, int64_t batch_idx) override;
  StepOutput validation_step(const Batch& batch, int64_t batch_idx) override;
  // batch.input: row ids [N]; generates N samples from the prompt, prints them on request, and
  // returns the tokens [N, prompt + max_new_tokens].
  at::Tensor predict_step(const Batch& batch, int64_t batch_idx) override;
  std::vector<OptimizerConfig> configure_optimizers() override;

 private:
  struct Layers;
  void check_length(int64_t length) const;
  at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& target) const;

  std::unique_ptr<Layers> layers_;
  int64_t block_size_ = 0;
  bool checkpoint_activations_ = false;
  // exp(mean token loss) over the whole validation epoch (not a mean of per-batch exps).
  metrics::Perplexity val_ppl_;
};

// The corpus as byte tokens. prepare_data() (rank 0 of each node) writes two uint16 token files,
// train.bin and val.bin, once per corpus content and split (atomically: temporary file, fsync,
// rename); every later run maps the same files. Training draws random windows of block_size + 1
// tokens (every offset is a window; shuffled from seed), validation walks non-overlapping
// windows of val.bin in order.
class CharCorpusDataModule : public DataModule {
 public:
  static constexpr auto hparams_schema = kCharCorpusHyperParams;
  explicit CharCorpusDataModule(const Options& hparams);

  void prepare_data() override;
  void setup(Stage stage) override;
  std::unique_ptr<BatchLoader> train_loader() override;
  std::unique_ptr<BatchLoader> val_loader() override;
  std::unique_ptr<BatchLoader> predict_loader() override;
  // The batch-size finder's handle: every loader reads [data] batch_size when it is made.
  int64_t batch_size() const override { return hparams.get_int("batch_size"); }
  void set_batch_size(int64_t n) override { hparams.set("batch_size", n); }

  // Where this corpus's token files are (they exist after prepare_data()).
  std::filesystem::path train_file() const { return token_dir_ / "train.bin"; }
  std::filesystem::path val_file() const { return token_dir_ / "val.bin"; }

 private:
  std::filesystem::path token_dir_;
  std::vector<std::filesystem::path> corpus_files_;
};

}  // namespace fulgur::examples
