// Built-in callback `model_pruning`: Lightning's ModelPruning with magnitude pruning, unstructured
// (pruning_fn = "l1_unstructured": single weights) or structured (pruning_fn = "ln_structured":
// whole slices along pruning_dim, e.g. rows of a Linear weight or output channels of a Conv, ranked
// by their Ln norm with n = pruning_norm, as torch.nn.utils.prune.ln_structured). At the end of
// each training epoch from start_epoch to end_epoch it prunes `amount` of what is still unpruned
// (torch's cumulative rule: two prunings of 0.5 leave a quarter; for structured pruning the
// fraction counts the slices not yet pruned), choosing the smallest magnitudes (norms), over all
// selected parameters together (use_global_unstructured, unstructured only, as in Lightning) or
// parameter by parameter. The selected parameters are those whose own name (the last part of the
// dotted name) is in parameter_names, as Lightning's parameter_names. Pruned weights are zeroed and
// kept at zero after every optimizer step (torch's forward pre-hook computes weight = weight_orig *
// mask instead; the weights the model uses are the same); at the end of training the zeros are
// final (Lightning's make_pruning_permanent: there is no reparametrization to remove). After each
// pruning the sparsity is sent to the loggers as "pruning/sparsity" (and per parameter,
// "pruning/sparsity/<name>", with verbose = 2). The masks are saved in checkpoints, so a resumed
// run keeps them.
//
// Not offered: random pruning, the lottery ticket reset and resample_parameters.
#include <fulgur/blocks.h>
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>

#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'model_pruning'";

struct Pruned {
  std::string name;
  at::Tensor param;
  at::Tensor mask;  // same dtype as the parameter: 1 kept, 0 pruned
};

class ModelPruning final : public fulgur::CallbackBase<ModelPruning> {
 public:
  FULGUR_OPTIONS(Options,
                 (string, pruning_fn,
                  "\"l1_unstructured\" (single weights, smallest magnitude first) or \"ln_structured\" "
                  "(whole slices along pruning_dim, smallest Ln norm first)",
                  "l1_unstructured"),
                 (integer, pruning_dim,
                  "ln_structured: the dimension whose slices are pruned (0: rows of a Linear weight, output "
                  "channels of a Conv; 1: columns / input channels)",
                  0),
                 (floating, pruning_norm,
                  "ln_structured (required there): n of the Ln norm that ranks the slices (1, 2, ... inf)", nan),
                 (floating, amount, "Fraction of the still unpruned weights pruned at each pruning epoch", 0.5),
                 (string_list, parameter_names, "Parameter names to prune (the last part of dotted names)", ["weight"]),
                 (boolean, use_global_unstructured,
                  "One magnitude threshold over all selected parameters; false: per parameter (required "
                  "for ln_structured)",
                  true),
                 (integer, start_epoch, "First epoch (0-based) whose end prunes", 0),
                 (integer, end_epoch, "Last epoch whose end prunes; -1: every epoch to the end", -1),
                 (integer, verbose, "0: quiet, 1: log the sparsity, 2: also per parameter", 0));

  explicit ModelPruning(const Options& options)
      : amount_(options.amount),
        names_(options.parameter_names),
        global_(options.use_global_unstructured),
        start_epoch_(options.start_epoch),
        end_epoch_(options.end_epoch),
        verbose_(options.verbose),
        dim_(options.pruning_dim),
        norm_(options.pruning_norm) {
    const std::string& fn = options.pruning_fn;
    options.check(fn == "l1_unstructured" || fn == "ln_structured", "pruning_fn",
                  "is not available; use \"l1_unstructured\" (single weights by magnitude) or \"ln_structured\" "
                  "(whole slices along pruning_dim by their Ln norm)");
    structured_ = fn == "ln_structured";
    if (structured_) {
      // Lightning refuses global pruning for structured methods: norms of slices of differently
      // shaped parameters are not comparable.
      options.check(!global_, "pruning_fn", "prunes parameter by parameter; set use_global_unstructured = false");
      options.check(!std::isnan(norm_), "pruning_fn",
                    "needs pruning_norm, the n of the Ln norm that ranks the slices (1, 2, ... or inf)");
      options.check(norm_ > 0, "pruning_norm", "must be > 0 (1, 2, ... or inf)");
    } else {
      if (!std::isnan(norm_))
        throw Error(ErrorKind::config, fmt::format("{}: pruning_norm applies to pruning_fn = \"ln_structured\" only; "
                                                   "remove it or change pruning_fn",
                                                   kOwner));
      if (dim_ != 0)
        throw Error(ErrorKind::config, fmt::format("{}: pruning_dim applies to pruning_fn = \"ln_structured\" only; "
                                                   "remove it or change pruning_fn",
                                                   kOwner));
    }
    options.check(amount_ > 0.0 && amount_ < 1.0, "amount",
                  "must lie in (0, 1): the fraction of the unpruned weights pruned at each pruning epoch");
    if (names_.empty())
      throw Error(ErrorKind::config,
                  fmt::format("{}: parameter_names is empty; name the parameters to prune, e.g. [\"weight\"]", kOwner));
    options.check(start_epoch_ >= 0, "start_epoch", "must be >= 0");
    options.check(end_epoch_ == -1 || end_epoch_ >= start_epoch_, "end_epoch",
                  fmt::format("is before start_epoch = {}; use -1 for no end", start_epoch_));
    options.check(verbose_ >= 0 && verbose_ <= 2, "verbose", "must be 0, 1 or 2");
  }

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    pruned_.clear();
    model_ = &trainer.model();
    const std::set<std::string> wanted(names_.begin(), names_.end());
    for (const auto& item : trainer.model().named_parameters(/*recurse=*/true)) {
      const std::string& name = item.key();
      const std::string leaf = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
      if (!wanted.count(leaf) || !at::isFloatingType(item.value().scalar_type())) continue;
      const int64_t dims = item.value().dim();
      if (structured_ && (dim_ >= dims || dim_ < -dims))
        throw Error(ErrorKind::config,
                    fmt::format("{}: pruning_dim = {} does not exist in '{}' of shape [{}]; choose a "
                                "dimension in [{}, {}] or leave '{}' out of parameter_names",
                                kOwner, dim_, name, fmt::join(item.value().sizes(), ", "), -dims, dims - 1, leaf));
      pruned_.push_back({name, item.value(), at::ones_like(item.value())});
    }
    if (pruned_.empty())
      throw Error(ErrorKind::config, fmt::format("{}: parameter_names = [{}] selects no floating-point parameter of "
                                                 "the model (the names are the last part of the dotted names, such "
                                                 "as \"weight\" in \"fc1.weight\")",
                                                 kOwner, fmt::join(names_, ", ")));
    prunings_ = 0;
    last_epoch_ = -1;
    if (pending_) {
      restore(*pending_);
      pending_.reset();
      apply_masks();
    }
  }

  // Keeps pruned weights at zero after each optimizer step.
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&, int64_t) override {
    if (prunings_ > 0) apply_masks();
  }

  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    const int64_t epoch = trainer.current_epoch();
    if (epoch < start_epoch_ || (end_epoch_ >= 0 && epoch > end_epoch_) || epoch == last_epoch_) return;
    prune();
    last_epoch_ = epoch;
    ++prunings_;
    fulgur::MetricMap row{{"pruning/sparsity", sparsity()}};
    if (verbose_ >= 2)
      for (const auto& p : pruned_) row["pruning/sparsity/" + p.name] = sparsity_of(p);
    if (verbose_ >= 1)
      fulgur::log::info(fmt::format("{}: epoch {}: pruned to a sparsity of {:.4f} over {} parameter(s)", kOwner, epoch,
                                    row["pruning/sparsity"], pruned_.size()));
    if (trainer.has_logger()) trainer.log_metrics(row, kOwner);
  }

  void on_train_end(fulgur::TrainerContext&) override {
    if (prunings_ == 0) return;
    apply_masks();
    fulgur::log::info(fmt::format("{}: pruning made permanent: sparsity {:.4f} over {} parameter(s)", kOwner,
                                  sparsity(), pruned_.size()));
  }

  std::string state_key() const override { return "ModelPruning"; }
  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    c10::impl::GenericDict masks(c10::StringType::get(), c10::TensorType::get());
    for (const auto& p : pruned_) masks.insert(p.name, p.mask.to(at::kBool).to(at::kCPU));
    state.insert("masks", masks);
    state.insert("prunings", prunings_);
    state.insert("last_epoch", last_epoch_);
    out = c10::IValue(state);
  }
  // Restored before on_fit_start, when the parameters are not known yet: kept until then. A state
  // saved before any pruning has nothing to restore.
  void load_state_dict(const c10::IValue& state) override {
    auto dict = support::expect_dict(kOwner, state);
    if (support::get_optional_int(kOwner, dict, "prunings").value_or(0) > 0) pending_ = dict;
  }

 private:
  void restore(const c10::impl::GenericDict& state) {
    prunings_ = support::get_optional_int(kOwner, state, "prunings").value_or(0);
    last_epoch_ = support::get_optional_int(kOwner, state, "last_epoch").value_or(-1);
    auto masks = support::find_value(state, "masks");
    if (!masks || !masks->isGenericDict()) return;
    const auto dict = masks->toGenericDict();
    for (auto& p : pruned_) {
      auto it = dict.find(p.name);
      if (it == dict.end() || it->value().toTensor().sizes() != p.param.sizes())
        throw Error(ErrorKind::checkpoint, fmt::format("{}: the checkpoint has no mask of the right shape for '{}'; "
                                                       "resume with the same model and parameter_names",
                                                       kOwner, p.name));
      p.mask = it->value().toTensor().to(p.param.options());
    }
  }

  // Under a strategy that shards parameters (fsdp, zero_stage = 3), the weights are made whole
  // around reading and zeroing them (a collective: every rank prunes and masks together, with the
  // same masks) and the strategy writes the zeros back to its shards; otherwise the guard does
  // nothing.
  void apply_masks() {
    fulgur::FullParameters whole(*model_);
    at::NoGradGuard no_grad;
    for (auto& p : pruned_) p.param.detach().mul_(p.mask);
  }

  // Prunes round(amount * unpruned) of the unpruned weights with the smallest magnitude.
  void prune() {
    fulgur::FullParameters whole(*model_);  // nests with apply_masks' at the end
    at::NoGradGuard no_grad;
    if (global_) {
      std::vector<at::Tensor> scores;
      for (const auto& p : pruned_) scores.push_back(score(p).to(at::kFloat).to(at::kCPU));
      at::Tensor all = at::cat(scores);
      at::Tensor drop = choose(all);
      int64_t offset = 0;
      for (auto& p : pruned_) {
        const int64_t n = p.param.numel();
        at::Tensor part = drop.slice(0, offset, offset + n).view(p.param.sizes()).to(p.mask.device());
        p.mask.masked_fill_(part, 0);
        offset += n;
      }
    } else if (structured_) {
      for (auto& p : pruned_) prune_slices(p);
    } else {
      for (auto& p : pruned_) p.mask.masked_fill_(choose(score(p)).view(p.param.sizes()), 0);
    }
    apply_masks();
  }

  // ln_structured: ranks the slices along dim_ by the Ln norm of their weights and zeroes the
  // masks of the round(amount * unpruned slices) smallest; pruned slices never come back.
  void prune_slices(Pruned& p) const {
    const int64_t dims = p.param.dim();
    const int64_t dim = dim_ < 0 ? dim_ + dims : dim_;
    std::vector<int64_t> others;
    for (int64_t d = 0; d < dims; ++d)
      if (d != dim) others.push_back(d);
    at::Tensor norms = at::linalg_vector_norm(p.param.detach().to(at::kFloat), norm_, others, /*keepdim=*/false);
    // A slice is pruned when its mask is all zero; its score is +inf so it is never chosen again.
    at::Tensor alive = at::linalg_vector_norm(p.mask.to(at::kFloat), 1.0, others, false) > 0;
    at::Tensor scores =
        at::where(alive, norms, at::full_like(norms, std::numeric_limits<double>::infinity())).reshape({-1});
    at::Tensor drop = choose(scores).to(p.mask.device());
    std::vector<int64_t> shape(static_cast<size_t>(dims), 1);
    shape[static_cast<size_t>(dim)] = p.param.size(dim);
    p.mask.masked_fill_(drop.view(shape).expand_as(p.mask), 0);
  }

  // |w| where unpruned, +inf where pruned (never chosen again), flattened.
  static at::Tensor score(const Pruned& p) {
    at::Tensor magnitude = p.param.detach().abs().reshape({-1});
    return at::where(p.mask.reshape({-1}) == 0, at::full_like(magnitude, std::numeric_limits<double>::infinity()),
                     magnitude);
  }

  // A boolean vector marking the k smallest unpruned scores, k = round(amount * unpruned) with
  // Python's round (half to even), as torch.nn.utils.prune counts.
  at::Tensor choose(const at::Tensor& scores) const {
    const int64_t unpruned = scores.isfinite().sum().item<int64_t>();
    const int64_t k = static_cast<int64_t>(std::nearbyint(amount_ * static_cast<double>(unpruned)));
    at::Tensor drop = at::zeros_like(scores, scores.options().dtype(at::kBool));
    if (k == 0) return drop;
    at::Tensor indices = std::get<1>(at::topk(scores, k, /*dim=*/0, /*largest=*/false));
    drop.index_fill_(0, indices, true);
    return drop;
  }

  static double sparsity_of(const Pruned& p) {
    return 1.0 - p.mask.sum().item<double>() / static_cast<double>(std::max<int64_t>(1, p.mask.numel()));
  }
  double sparsity() const {
    double zeros = 0, total = 0;
    for (const auto& p : pruned_) {
      zeros += static_cast<double>(p.mask.numel()) - p.mask.sum().item<double>();
      total += static_cast<double>(p.mask.numel());
    }
    return total > 0 ? zeros / total : 0.0;
  }

  torch::nn::Module* model_ = nullptr;  // the model whose weights are pruned (on_fit_start)
  double amount_;
  std::vector<std::string> names_;
  bool global_;
  int64_t start_epoch_;
  int64_t end_epoch_;
  int64_t verbose_;
  int64_t dim_;
  double norm_;
  bool structured_ = false;
  std::vector<Pruned> pruned_;
  int64_t prunings_ = 0;
  int64_t last_epoch_ = -1;
  std::optional<c10::impl::GenericDict> pending_;
};

}  // namespace

FULGUR_PLUGIN(ModelPruning, "model_pruning", "0.2.0",
              "Magnitude pruning (L1 unstructured or Ln structured) at the end of training epochs (Lightning's "
              "ModelPruning), made permanent at the end; the sparsity goes to the loggers")
