// Accuracy, precision, recall, F-beta and the confusion matrix: counts per class accumulated on
// the batch's device, reduced exactly as torchmetrics 1.9 reduces them (its formulas are quoted
// where they are not obvious, so the two can be compared line by line).
#include <fulgur/error.h>
#include <fulgur/metrics.h>

#include <torch/torch.h>

#include <fmt/format.h>

namespace fulgur::metrics {

namespace {

at::Tensor safe_divide(const at::Tensor& num, const at::Tensor& den) {
  const at::Tensor n = num.to(at::kDouble), d = den.to(at::kDouble);
  return at::where(d != 0, n / d, at::zeros_like(n));
}

// torchmetrics' normalize_logits_if_needed, without a host sync: scores outside [0, 1] anywhere in
// the batch are taken for logits.
at::Tensor to_probabilities(const at::Tensor& scores, bool softmax) {
  const at::Tensor outside = ((scores < 0) | (scores > 1)).any();
  return at::where(outside, softmax ? scores.softmax(1) : scores.sigmoid(), scores);
}

// Predicted labels (N,) from (N, C) scores or labels; with top_k > 1 the target when it is among
// the k best, else the best (torchmetrics' _refine_preds_oh).
at::Tensor multiclass_labels(const at::Tensor& preds, const at::Tensor& target, int64_t top_k) {
  if (preds.dim() == target.dim() + 1) {
    if (top_k == 1) return preds.argmax(1);
    const at::Tensor best = std::get<1>(preds.topk(top_k, 1));
    const at::Tensor hit = (best == target.unsqueeze(1)).any(1);
    return at::where(hit, target, best.select(1, 0));
  }
  if (top_k != 1)
    throw Error(ErrorKind::invalid_argument, "metrics: top_k > 1 needs (N, C) scores as preds, not labels");
  return preds.to(at::kLong);
}

// (C, C) counts, rows targets, columns predictions.
at::Tensor confusion(const at::Tensor& labels, const at::Tensor& target, int64_t classes) {
  const at::Tensor bins = at::bincount(target.to(at::kLong) * classes + labels.to(at::kLong), {}, classes * classes);
  if (bins.numel() != classes * classes)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("metrics: a target or prediction is not a class in [0, {})", classes));
  return bins.reshape({classes, classes});
}

void check_same_batch(const at::Tensor& preds, const at::Tensor& target) {
  if (preds.dim() == 0 || target.dim() == 0 || preds.size(0) != target.size(0))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("metrics: preds {} and target {} do not describe the same batch", c10::str(preds.sizes()),
                            c10::str(target.sizes())));
}

}  // namespace

StatScores::StatScores(ClassificationOptions options) : options_(std::move(options)) {
  // torchmetrics.Accuracy(task=...) and its siblings default to micro (their Multiclass* classes
  // to macro); Lightning code uses the former.
  if (!options_.average_) options_.average_ = Average::micro;
  const int64_t c = options_.num_classes_;
  if (options_.task_ != Task::binary && c < 1)
    throw Error(ErrorKind::invalid_argument, fmt::format("metrics: num_classes = {} must be >= 1", c));
  if (options_.top_k_ < 1 || (options_.task_ == Task::multiclass && options_.top_k_ > c))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("metrics: top_k = {} must be in [1, num_classes = {}]", options_.top_k_, c));
  const at::Tensor zeros = options_.task_ == Task::binary ? at::zeros({}, at::kLong) : at::zeros({c}, at::kLong);
  for (const char* name : {"tp", "fp", "tn", "fn"}) add_state(name, zeros, StateReduction::sum);
}

void StatScores::update(const at::Tensor& preds_in, const at::Tensor& target_in) {
  at::Tensor preds = preds_in.detach(), target = target_in.detach();
  check_same_batch(preds, target);
  for (size_t i = 0; i < 4; ++i)
    if (state(i).device() != preds.device()) state(i) = state(i).to(preds.device());
  if (options_.task_ == Task::multiclass) {
    const int64_t c = options_.num_classes_;
    at::Tensor labels = multiclass_labels(preds, target, options_.top_k_);
    if (options_.ignore_index_) {
      const at::Tensor keep = target != *options_.ignore_index_;
      labels = labels.index({keep});
      target = target.index({keep});
    }
    const at::Tensor cm = confusion(labels, target, c);
    const at::Tensor tp = cm.diagonal(), fp = cm.sum(0) - tp, fn = cm.sum(1) - tp;
    state(0) += tp;
    state(1) += fp;
    state(2) += labels.numel() - tp - fp - fn;
    state(3) += fn;
    return;
  }
  // Binary and multilabel: thresholded probabilities against 0/1 targets; ignored targets become
  // -1, which matches neither.
  at::Tensor p = preds.is_floating_point()
                     ? (to_probabilities(preds, /*softmax=*/false) > options_.threshold_).to(at::kLong)
                     : preds.to(at::kLong);
  at::Tensor t = target.to(at::kLong);
  if (options_.ignore_index_) t = at::where(t == *options_.ignore_index_, at::full_like(t, -1), t);
  if (options_.task_ == Task::binary) {
    p = p.flatten();
    t = t.flatten();
  } else {
    p = p.reshape({p.size(0), options_.num_classes_, -1}).transpose(0, 1).reshape({options_.num_classes_, -1});
    t = t.reshape({t.size(0), options_.num_classes_, -1}).transpose(0, 1).reshape({options_.num_classes_, -1});
  }
  const int64_t dim = -1;
  state(0) += ((t == p) & (t == 1)).sum(dim);
  state(1) += ((t != p) & (t == 0)).sum(dim);
  state(2) += ((t == p) & (t == 0)).sum(dim);
  state(3) += ((t != p) & (t == 1)).sum(dim);
}

// torchmetrics' _adjust_weights_safe_divide.
at::Tensor StatScores::average(const at::Tensor& score, const at::Tensor& tp, const at::Tensor& fp,
                               const at::Tensor& fn) const {
  if (options_.task_ == Task::binary || options_.average_ == Average::none) return score;
  at::Tensor weights;
  if (options_.average_ == Average::weighted)
    weights = (tp + fn).to(at::kDouble);
  else {
    weights = at::ones_like(score);
    if (options_.task_ == Task::multiclass)
      weights.masked_fill_(options_.top_k_ == 1 ? (tp + fp + fn == 0) : (tp + fn == 0), 0.0);
  }
  return safe_divide(weights * score, weights.sum(-1, true)).sum(-1);
}

at::Tensor Accuracy::compute_from(const std::vector<at::Tensor>& v) const {
  const at::Tensor &tp = v[0], &fp = v[1], &tn = v[2], &fn = v[3];
  const bool multilabel = options_.task_ == Task::multilabel;
  if (options_.task_ == Task::binary) return safe_divide(tp + tn, tp + tn + fp + fn);
  if (options_.average_ == Average::micro)
    return multilabel ? safe_divide(tp.sum() + tn.sum(), (tp + tn + fp + fn).sum())
                      : safe_divide(tp.sum(), (tp + fn).sum());
  const at::Tensor score = multilabel ? safe_divide(tp + tn, tp + tn + fp + fn) : safe_divide(tp, tp + fn);
  return average(score, tp, fp, fn);
}

at::Tensor Precision::compute_from(const std::vector<at::Tensor>& v) const {
  const at::Tensor &tp = v[0], &fp = v[1], &fn = v[3];
  if (options_.task_ == Task::binary) return safe_divide(tp, tp + fp);
  if (options_.average_ == Average::micro) return safe_divide(tp.sum(), (tp + fp).sum());
  return average(safe_divide(tp, tp + fp), tp, fp, fn);
}

at::Tensor Recall::compute_from(const std::vector<at::Tensor>& v) const {
  const at::Tensor &tp = v[0], &fp = v[1], &fn = v[3];
  if (options_.task_ == Task::binary) return safe_divide(tp, tp + fn);
  if (options_.average_ == Average::micro) return safe_divide(tp.sum(), (tp + fn).sum());
  return average(safe_divide(tp, tp + fn), tp, fp, fn);
}

at::Tensor F1Score::compute_from(const std::vector<at::Tensor>& v) const {
  const double b2 = beta_ * beta_;
  auto f = [&](const at::Tensor& tp, const at::Tensor& fp, const at::Tensor& fn) {
    const at::Tensor t = tp.to(at::kDouble);
    return safe_divide((1 + b2) * t, (1 + b2) * t + b2 * fn.to(at::kDouble) + fp.to(at::kDouble));
  };
  const at::Tensor &tp = v[0], &fp = v[1], &fn = v[3];
  if (options_.task_ == Task::binary) return f(tp, fp, fn);
  if (options_.average_ == Average::micro) return f(tp.sum(), fp.sum(), fn.sum());
  // torchmetrics' _fbeta_reduce does not pass top_k on: its macro mask is the top-1 one.
  ClassificationOptions top1 = options_;
  top1.top_k_ = 1;
  const at::Tensor score = f(tp, fp, fn);
  if (top1.average_ == Average::none) return score;
  at::Tensor weights = top1.average_ == Average::weighted ? (tp + fn).to(at::kDouble) : at::ones_like(score);
  if (top1.average_ == Average::macro && options_.task_ == Task::multiclass)
    weights.masked_fill_(tp + fp + fn == 0, 0.0);
  return safe_divide(weights * score, weights.sum(-1, true)).sum(-1);
}

ConfusionMatrix::ConfusionMatrix(int64_t num_classes, Normalize normalize, std::optional<int64_t> ignore_index)
    : num_classes_(num_classes), normalize_(normalize), ignore_index_(ignore_index) {
  if (num_classes < 2)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("metrics: ConfusionMatrix needs num_classes >= 2, got {}", num_classes));
  add_state("confmat", at::zeros({num_classes, num_classes}, at::kLong), StateReduction::sum);
}

void ConfusionMatrix::update(const at::Tensor& preds_in, const at::Tensor& target_in) {
  at::Tensor preds = preds_in.detach(), target = target_in.detach();
  check_same_batch(preds, target);
  if (state(0).device() != preds.device()) state(0) = state(0).to(preds.device());
  at::Tensor labels = multiclass_labels(preds, target, 1);
  if (ignore_index_) {
    const at::Tensor keep = target != *ignore_index_;
    labels = labels.index({keep});
    target = target.index({keep});
  }
  state(0) += confusion(labels, target, num_classes_);
}

at::Tensor ConfusionMatrix::compute_from(const std::vector<at::Tensor>& v) const {
  const at::Tensor& cm = v[0];
  if (normalize_ == Normalize::none) return cm;
  const at::Tensor c = cm.to(at::kDouble);
  at::Tensor out = normalize_ == Normalize::true_  ? c / c.sum(-1, true)
                   : normalize_ == Normalize::pred ? c / c.sum(-2, true)
                                                   : c / c.sum();
  return at::nan_to_num(out, 0.0, 0.0, 0.0);  // rows or columns without samples
}

}  // namespace fulgur::metrics
