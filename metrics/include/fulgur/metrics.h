// Stateful metrics for use inside steps, computed as torchmetrics computes them: update() per
// batch accumulates states on the batch's device (no host copy of the values; ignore_index and,
// on CUDA, bincount need a device sync), compute() reduces them (across ranks when the metric is
// synced), reset() starts over.
//
//   struct Net : fulgur::Module {
//     Net() { val_acc.sync_with(*this); }   // states all-reduced through the Trainer's strategy
//     fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t) override {
//       val_acc.update(forward(b.input), b.target);
//       return {};
//     }
//     void on_validation_epoch_end() override {
//       log("val/acc", val_acc.compute());
//       val_acc.reset();
//     }
//     fulgur::metrics::Accuracy val_acc{fulgur::metrics::ClassificationOptions::multiclass(10)};
//   };
//
// Inputs follow torchmetrics: multiclass preds are (N, C) scores (logits or probabilities) or (N,)
// labels with (N,) integer targets; multilabel and binary preds are scores of the target's shape,
// passed through a sigmoid when any lies outside [0, 1] and then thresholded.
#pragma once

#include <fulgur/metric.h>
#include <fulgur/types.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fulgur::metrics {

// How each class's score is combined (torchmetrics' `average`): micro pools the counts of every
// class, macro averages the per-class scores (classes never seen nor predicted left out), weighted
// averages them by support, none returns one score per class.
enum class Average { micro, macro, weighted, none };

enum class Task { binary, multiclass, multilabel };

// What a classification metric is about. Start from multiclass(n), multilabel(n) or binary().
struct ClassificationOptions {
  static ClassificationOptions multiclass(int64_t num_classes) {
    ClassificationOptions o;
    o.task_ = Task::multiclass;
    o.num_classes_ = num_classes;
    return o;
  }
  static ClassificationOptions multilabel(int64_t num_labels) {
    ClassificationOptions o;
    o.task_ = Task::multilabel;
    o.num_classes_ = num_labels;
    return o;
  }
  static ClassificationOptions binary() {
    ClassificationOptions o;
    o.task_ = Task::binary;
    o.num_classes_ = 1;
    return o;
  }
  ClassificationOptions& average(Average v) {
    average_ = v;
    return *this;
  }
  // Multiclass: a sample counts as right when its target is among the k highest scores.
  ClassificationOptions& top_k(int64_t v) {
    top_k_ = v;
    return *this;
  }
  // Binary and multilabel: a probability above it is a positive prediction.
  ClassificationOptions& threshold(double v) {
    threshold_ = v;
    return *this;
  }
  // Targets equal to it are left out (padding).
  ClassificationOptions& ignore_index(int64_t v) {
    ignore_index_ = v;
    return *this;
  }

  Task task_ = Task::multiclass;
  int64_t num_classes_ = 2;
  // Unset: the metric's default, torchmetrics' for the same entry point: micro for Accuracy,
  // Precision, Recall and F1Score (torchmetrics.Accuracy(task="multiclass", ...), which Lightning
  // code uses), macro for AUROC. (torchmetrics' task classes, MulticlassAccuracy and its siblings,
  // default to macro: write .average(Average::macro) for their values.)
  std::optional<Average> average_;
  int64_t top_k_ = 1;
  double threshold_ = 0.5;
  std::optional<int64_t> ignore_index_;
};

// True/false positives/negatives per class (one class for binary), the states accuracy,
// precision, recall and F-scores are computed from. Their average defaults to micro, as
// torchmetrics.Accuracy / Precision / Recall / F1Score(task=...) do.
class StatScores : public Metric {
 public:
  explicit StatScores(ClassificationOptions options);
  void update(const at::Tensor& preds, const at::Tensor& target) override;
  const ClassificationOptions& options() const { return options_; }

 protected:
  // score per class from the counts, then averaged as torchmetrics does.
  at::Tensor average(const at::Tensor& score, const at::Tensor& tp, const at::Tensor& fp, const at::Tensor& fn) const;
  ClassificationOptions options_;
};

class Accuracy : public StatScores {
 public:
  explicit Accuracy(ClassificationOptions options) : StatScores(std::move(options)) {}

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;
};

class Precision : public StatScores {
 public:
  explicit Precision(ClassificationOptions options) : StatScores(std::move(options)) {}

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;
};

class Recall : public StatScores {
 public:
  explicit Recall(ClassificationOptions options) : StatScores(std::move(options)) {}

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;
};

// F-beta (F1 by default): (1 + b^2) tp / ((1 + b^2) tp + b^2 fn + fp).
class F1Score : public StatScores {
 public:
  explicit F1Score(ClassificationOptions options, double beta = 1.0) : StatScores(std::move(options)), beta_(beta) {}

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;

 private:
  double beta_;
};

// Area under the ROC curve, exact (every distinct score is a threshold): binary, or multiclass
// one-vs-rest averaged macro (default, as torchmetrics.AUROC), weighted (by support) or none. Keeps every score until
// reset (as torchmetrics does with thresholds=None).
class AUROC : public Metric {
 public:
  explicit AUROC(ClassificationOptions options);
  void update(const at::Tensor& preds, const at::Tensor& target) override;

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;

 private:
  ClassificationOptions options_;
};

enum class Normalize { none, true_, pred, all };

// Multiclass confusion matrix: rows are targets, columns predictions; counts (int64), or rates
// normalized over targets (true_), predictions (pred) or everything (all).
class ConfusionMatrix : public Metric {
 public:
  explicit ConfusionMatrix(int64_t num_classes, Normalize normalize = Normalize::none,
                           std::optional<int64_t> ignore_index = std::nullopt);
  void update(const at::Tensor& preds, const at::Tensor& target) override;

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;

 private:
  int64_t num_classes_;
  Normalize normalize_;
  std::optional<int64_t> ignore_index_;
};

class MeanSquaredError : public Metric {
 public:
  MeanSquaredError();
  void update(const at::Tensor& preds, const at::Tensor& target) override;

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;
};

class MeanAbsoluteError : public Metric {
 public:
  MeanAbsoluteError();
  void update(const at::Tensor& preds, const at::Tensor& target) override;

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;
};

// exp(mean negative log-likelihood) of (B, T, V) logits against (B, T) token ids.
class Perplexity : public Metric {
 public:
  explicit Perplexity(std::optional<int64_t> ignore_index = std::nullopt);
  void update(const at::Tensor& preds, const at::Tensor& target) override;

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& values) const override;

 private:
  std::optional<int64_t> ignore_index_;
};

}  // namespace fulgur::metrics
