// Muon (Jordan et al. 2024; Liu et al., "Muon is Scalable for LLM Training", 2025): momentum whose
// update is orthogonalized by a Newton-Schulz iteration, for the 2-D weights of hidden layers.
// Equal step for step to PyTorch 2.11's torch.optim.Muon, with AdamW (torch.optim.AdamW's
// arithmetic) for every other parameter in the same optimizer:
//
//   - a group with use_muon(true) (the default) is stepped by Muon; each of its parameters must be
//     a 2-D matrix (a convolution's 4-D kernel must be viewed as 2-D by the model: not done here);
//   - a group with use_muon(false) is stepped by AdamW with its betas, adamw_eps and weight_decay.
//
// Which parameters go where is the user's choice, made when building the groups; the usual one
// (hidden matrices to Muon; embeddings, the output head, biases and norm gains to AdamW) is what
// muon_param_groups() builds from a Module. One optimizer, one state and one checkpoint for both.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fulgur::optim {

/// Hyperparameters of one parameter group of Muon (chained setters, as torch::optim::AdamWOptions).
/// The defaults are torch.optim.Muon's for the Muon fields and torch.optim.AdamW's for the AdamW
/// ones; lr and weight_decay serve whichever algorithm steps the group.
struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 1e-3);
  using coefficients_t = std::tuple<double, double, double>;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(double, lr) = 1e-3;
  /// Decoupled: p *= 1 - lr * weight_decay (torch.optim.Muon's default 0.1; AdamW's is 0.01).
  TORCH_ARG(double, weight_decay) = 0.1;
  /// true: this group is stepped by Muon (2-D parameters only); false: by AdamW.
  TORCH_ARG(bool, use_muon) = true;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  /// (a, b, c) of the quintic Newton-Schulz polynomial a*X + b*(XX^T)X + c*(XX^T)^2 X.
  TORCH_ARG(coefficients_t, ns_coefficients) = std::make_tuple(3.4445, -4.7750, 2.0315);
  /// Floor of the Frobenius norm the input is divided by before the iteration.
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  /// "original": lr * sqrt(max(1, A/B)) (Keller Jordan's); "match_rms_adamw": lr * 0.2 *
  /// sqrt(max(A, B)) (Moonshot's, reuses AdamW's lr and weight decay), for an A x B matrix.
  TORCH_ARG(std::string, adjust_lr_fn) = "original";
  /// AdamW groups only.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// AdamW groups only: the term added to the denominator.
  TORCH_ARG(double, adamw_eps) = 1e-8;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const MuonOptions& lhs, const MuonOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state: momentum_buffer for Muon parameters; step, exp_avg and exp_avg_sq for
/// AdamW ones (the keys of torch.optim.Muon's and torch.optim.AdamW's state dicts).
struct MuonParamState : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const MuonParamState& lhs, const MuonParamState& rhs);
};

/// A Muon parameter that holds only some rows of its matrix, as a ZeRO strategy (fsdp) shards it:
/// what Newton-Schulz needs to see the whole matrix. Muon's momentum and AdamW's moments are
/// element-wise and stay on the rows; only the orthogonalization is of the whole matrix.
struct MuonRowShard {
  /// The shard's first row in the matrix.
  int64_t first_row = 0;
  /// The whole matrix's shape (the learning-rate adjustment reads it too).
  int64_t rows = 0, cols = 0;
  /// Every rank's rows of a tensor shaped like the shard (bfloat16, Newton-Schulz's input dtype),
  /// gathered into the whole [rows, cols] matrix. A collective: every rank calls it for the same
  /// parameters in the same order.
  std::function<torch::Tensor(const torch::Tensor& local_rows)> gather;
};

/// The MuonRowShard of a parameter the optimizer holds, or nullptr for a whole matrix.
using MuonShardLookup = std::function<const MuonRowShard*(const torch::Tensor& param)>;

/// Muon for use_muon groups and AdamW for the others, in one optimizer.
///
/// Under a sharding strategy (set_row_shards) each Muon matrix is "gathered per matrix": the
/// Nesterov update of this rank's rows is converted to bfloat16 (Newton-Schulz's first, element-wise
/// operation), all-gathered into the whole matrix, orthogonalized on every rank, and each rank
/// applies its own rows of the result. The matrix one process orthogonalizes is reproduced bit for
/// bit, at 2 bytes per element gathered.
class Muon : public torch::optim::Optimizer {
 public:
  explicit Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults = {});
  explicit Muon(std::vector<torch::Tensor> params, MuonOptions defaults = {})
      : Muon({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Installed by a strategy that replaces the parameters with row shards of them (nullptr: every
  /// parameter is whole, the default). Parameters the lookup does not know stay whole.
  void set_row_shards(MuonShardLookup lookup) { row_shards_ = std::move(lookup); }

 private:
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    torch::optim::serialize<MuonParamState, MuonOptions>(archive, self);
  }
  MuonShardLookup row_shards_;
};

/// torch.optim._muon._zeropower_via_newtonschulz: `steps` quintic Newton-Schulz iterations in
/// bfloat16 on G / max(||G||_F, eps) (transposed when G has more rows than columns), returning a
/// bfloat16 matrix close to U V^T of G's SVD. Bitwise equal to PyTorch's on the same input.
torch::Tensor zeropower_via_newtonschulz(const torch::Tensor& grad, MuonOptions::coefficients_t coefficients,
                                         int64_t steps, double eps);

/// The learning rate Muon applies to an A x B matrix under `adjust_lr_fn` (see MuonOptions).
double muon_adjusted_lr(double lr, const std::string& adjust_lr_fn, int64_t rows, int64_t cols);

/// Which of a Module's parameters muon_param_groups() gives to Muon.
struct MuonSplit {
  /// A parameter whose qualified name contains one of these stays with AdamW even if it is 2-D:
  /// embeddings and output heads, which Muon's authors leave to AdamW.
  std::vector<std::string> adamw_names = {"embed", "wte", "wpe", "lm_head"};
};

/// Two groups from `module`'s parameters (requires_grad only, in registration order): first the
/// 2-D ones not excluded by `split` with `muon` (use_muon forced true), then all the others
/// (biases, gains, embeddings, heads) with `adamw` (use_muon forced false). An empty group is left
/// out. For another split, build the OptimizerParamGroups yourself with use_muon set per group.
std::vector<torch::optim::OptimizerParamGroup> muon_param_groups(const torch::nn::Module& module, MuonOptions muon,
                                                                 MuonOptions adamw, const MuonSplit& split = {});

}  // namespace fulgur::optim
