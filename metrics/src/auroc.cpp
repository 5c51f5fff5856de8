// Exact AUROC (torchmetrics with thresholds=None): every distinct score is a threshold, the ROC
// curve starts at (0, 0) and its area is the trapezoid sum.
#include <fulgur/error.h>
#include <fulgur/metrics.h>

#include <torch/torch.h>

#include <fmt/format.h>

namespace fulgur::metrics {

namespace {

at::Tensor to_probabilities(const at::Tensor& scores, bool softmax) {
  const at::Tensor outside = ((scores < 0) | (scores > 1)).any();
  return at::where(outside, softmax ? scores.softmax(1) : scores.sigmoid(), scores);
}

// torchmetrics' _binary_clf_curve + _binary_roc_compute + _auc_compute_without_check. A curve
// without positives (or negatives) has tpr (fpr) = 0, as there.
at::Tensor binary_auroc(const at::Tensor& preds, const at::Tensor& positive) {
  const int64_t n = preds.numel();
  if (n == 0) return at::zeros({}, preds.options().dtype(at::kDouble));
  const at::Tensor order = preds.argsort(/*stable=*/true, /*dim=*/0, /*descending=*/true);
  const at::Tensor p = preds.index({order});
  const at::Tensor t = positive.index({order}).to(at::kDouble);
  const at::Tensor distinct = at::nonzero(p.slice(0, 1) - p.slice(0, 0, n - 1)).flatten();
  const at::Tensor idx = at::cat({distinct, at::full({1}, n - 1, distinct.options())});
  const at::Tensor tps_at = t.cumsum(0).index({idx});
  const at::Tensor fps_at = (idx + 1).to(at::kDouble) - tps_at;
  const at::Tensor zero = at::zeros({1}, tps_at.options());
  const at::Tensor tps = at::cat({zero, tps_at}), fps = at::cat({zero, fps_at});
  const at::Tensor tp_total = tps.select(0, -1), fp_total = fps.select(0, -1);
  const at::Tensor fpr = at::where(fp_total > 0, fps / fp_total, at::zeros_like(fps));
  const at::Tensor tpr = at::where(tp_total > 0, tps / tp_total, at::zeros_like(tps));
  return at::trapezoid(tpr, fpr);
}

}  // namespace

AUROC::AUROC(ClassificationOptions options) : options_(std::move(options)) {
  if (!options_.average_) options_.average_ = Average::macro;  // torchmetrics.AUROC's default
  if (options_.task_ == Task::multilabel)
    throw Error(ErrorKind::invalid_argument, "metrics: AUROC supports binary and multiclass (one-vs-rest) tasks");
  if (options_.task_ == Task::multiclass && options_.average_ == Average::micro)
    throw Error(ErrorKind::invalid_argument, "metrics: multiclass AUROC averages macro, weighted or none, not micro");
  const int64_t c = options_.task_ == Task::multiclass ? options_.num_classes_ : 0;
  add_state("preds", options_.task_ == Task::multiclass ? at::zeros({0, c}) : at::zeros({0}), StateReduction::cat);
  add_state("target", at::zeros({0}, at::kLong), StateReduction::cat);
}

void AUROC::update(const at::Tensor& preds_in, const at::Tensor& target_in) {
  at::Tensor preds = preds_in.detach(), target = target_in.detach().to(at::kLong);
  if (options_.task_ == Task::multiclass) {
    if (preds.dim() != 2 || preds.size(1) != options_.num_classes_ || target.dim() != 1 ||
        target.size(0) != preds.size(0))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("metrics: multiclass AUROC needs (N, {}) scores and (N,) targets, got {} and {}",
                              options_.num_classes_, c10::str(preds.sizes()), c10::str(target.sizes())));
    preds = to_probabilities(preds, /*softmax=*/true);
  } else {
    preds = to_probabilities(preds.flatten(), /*softmax=*/false);
    target = target.flatten();
  }
  if (options_.ignore_index_) {
    const at::Tensor keep = target != *options_.ignore_index_;
    preds = preds.index({keep});
    target = target.index({keep});
  }
  append(0, preds);
  append(1, target);
}

at::Tensor AUROC::compute_from(const std::vector<at::Tensor>& v) const {
  const at::Tensor &preds = v[0], &target = v[1];
  if (options_.task_ == Task::binary) return binary_auroc(preds, target == 1);
  const int64_t c = options_.num_classes_;
  std::vector<at::Tensor> per_class;
  for (int64_t k = 0; k < c; ++k) per_class.push_back(binary_auroc(preds.select(1, k), target == k));
  const at::Tensor res = at::stack(per_class);
  if (options_.average_ == Average::none) return res;
  const at::Tensor keep = ~res.isnan();
  if (options_.average_ == Average::macro) return res.index({keep}).mean();
  const at::Tensor support = at::bincount(target, {}, c).to(at::kDouble).index({keep});
  const at::Tensor total = support.sum();
  const at::Tensor w = at::where(total != 0, support / total, at::zeros_like(support));
  return (res.index({keep}) * w).sum();
}

}  // namespace fulgur::metrics
