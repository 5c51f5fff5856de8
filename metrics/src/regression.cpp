// Mean squared / absolute error and perplexity: running sums and counts (double on the batch's
// device), so the value over many batches is exact and sums across ranks.
#include <fulgur/error.h>
#include <fulgur/metrics.h>

#include <torch/torch.h>

#include <fmt/format.h>

namespace fulgur::metrics {

namespace {

void check_same_shape(const at::Tensor& preds, const at::Tensor& target, const char* metric) {
  if (preds.sizes() != target.sizes())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("metrics: {} needs preds and target of one shape, got {} and {}", metric,
                            c10::str(preds.sizes()), c10::str(target.sizes())));
}

void on_device(at::Tensor& state, const at::Tensor& like) {
  if (state.device() != like.device()) state = state.to(like.device());
}

}  // namespace

MeanSquaredError::MeanSquaredError() {
  add_state("sum_squared_error", at::zeros({}, at::kDouble), StateReduction::sum);
  add_state("total", at::zeros({}, at::kLong), StateReduction::sum);
}

void MeanSquaredError::update(const at::Tensor& preds, const at::Tensor& target) {
  check_same_shape(preds, target, "MeanSquaredError");
  on_device(state(0), preds);
  on_device(state(1), preds);
  const at::Tensor diff = preds.detach().to(at::kDouble) - target.detach().to(at::kDouble);
  state(0) += (diff * diff).sum();
  state(1) += preds.numel();
}

at::Tensor MeanSquaredError::compute_from(const std::vector<at::Tensor>& v) const { return v[0] / v[1]; }

MeanAbsoluteError::MeanAbsoluteError() {
  add_state("sum_abs_error", at::zeros({}, at::kDouble), StateReduction::sum);
  add_state("total", at::zeros({}, at::kLong), StateReduction::sum);
}

void MeanAbsoluteError::update(const at::Tensor& preds, const at::Tensor& target) {
  check_same_shape(preds, target, "MeanAbsoluteError");
  on_device(state(0), preds);
  on_device(state(1), preds);
  state(0) += (preds.detach().to(at::kDouble) - target.detach().to(at::kDouble)).abs().sum();
  state(1) += preds.numel();
}

at::Tensor MeanAbsoluteError::compute_from(const std::vector<at::Tensor>& v) const { return v[0] / v[1]; }

Perplexity::Perplexity(std::optional<int64_t> ignore_index) : ignore_index_(ignore_index) {
  add_state("total_log_probs", at::zeros({}, at::kDouble), StateReduction::sum);
  add_state("count", at::zeros({}, at::kLong), StateReduction::sum);
}

void Perplexity::update(const at::Tensor& preds, const at::Tensor& target) {
  if (preds.dim() != 3 || target.dim() != 2 || preds.size(0) != target.size(0) || preds.size(1) != target.size(1))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("metrics: Perplexity needs (B, T, V) logits and (B, T) targets, got {} and {}",
                            c10::str(preds.sizes()), c10::str(target.sizes())));
  on_device(state(0), preds);
  on_device(state(1), preds);
  const at::Tensor logits = preds.detach().reshape({-1, preds.size(2)}).to(at::kDouble);
  at::Tensor t = target.detach().reshape({-1}).to(at::kLong);
  at::Tensor mask = at::ones_like(t, at::kBool);
  if (ignore_index_) {
    mask = t != *ignore_index_;
    t = at::where(mask, t, at::zeros_like(t));
  }
  const at::Tensor log_p = logits.log_softmax(1).gather(1, t.unsqueeze(1)).squeeze(1);
  state(0) -= (log_p * mask).sum();
  state(1) += mask.sum();
}

at::Tensor Perplexity::compute_from(const std::vector<at::Tensor>& v) const { return (v[0] / v[1]).exp(); }

}  // namespace fulgur::metrics
