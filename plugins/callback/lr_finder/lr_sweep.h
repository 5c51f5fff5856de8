// The learning-rate range test of Lightning's LearningRateFinder as plain arithmetic, apart from the
// Trainer so that it can be tested by itself: which lr each sweep step uses, the smoothed loss, the
// divergence stop, and the suggestion (the steepest descent of the smoothed loss curve).
//
// What differs from Lightning, and why:
// - Step k of N uses min_lr * (max_lr / min_lr)^(k / (N - 1)) (linear: min_lr + k / (N - 1) *
//   (max_lr - min_lr)), so the sweep spans exactly [min_lr, max_lr]; Lightning's schedulers repeat
//   min_lr on the first two steps and never reach max_lr.
// - The smoothed loss is bias-corrected by the number of losses seen, beta^(k + 1) (Lightning uses
//   global_step + 1, which only matches a sweep that starts at step 0).
// - In exponential mode the gradient is taken along log10(lr), the axis the plot shows; Lightning
//   takes it along lr itself (torch.gradient with spacing=lrs), which divides by steps a million
//   times smaller at the low end of a 1e-8..1 sweep and so tends to suggest the first lrs looked at.
//   In linear mode both are the same.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace fulgur::lr_finder {

enum class SweepMode { exponential, linear };

struct LrSweepOptions {
  LrSweepOptions& min_lr(double v) {
    min_lr_ = v;
    return *this;
  }
  LrSweepOptions& max_lr(double v) {
    max_lr_ = v;
    return *this;
  }
  LrSweepOptions& num_training_steps(int64_t v) {
    num_training_steps_ = v;
    return *this;
  }
  LrSweepOptions& mode(SweepMode v) {
    mode_ = v;
    return *this;
  }
  // nan: never stop early.
  LrSweepOptions& early_stop_threshold(double v) {
    early_stop_threshold_ = v;
    return *this;
  }
  LrSweepOptions& beta(double v) {
    beta_ = v;
    return *this;
  }
  LrSweepOptions& skip_begin(int64_t v) {
    skip_begin_ = v;
    return *this;
  }
  LrSweepOptions& skip_end(int64_t v) {
    skip_end_ = v;
    return *this;
  }

  double min_lr_ = 1e-8;
  double max_lr_ = 1.0;
  int64_t num_training_steps_ = 100;
  SweepMode mode_ = SweepMode::exponential;
  double early_stop_threshold_ = 4.0;
  double beta_ = 0.98;
  int64_t skip_begin_ = 10;
  int64_t skip_end_ = 1;
};

struct SweepPoint {
  double lr;
  double loss;           // the step's loss as training_step returned it (nan when it returned none)
  double smoothed_loss;  // exponential moving average, bias-corrected
};

class LrSweep {
 public:
  explicit LrSweep(LrSweepOptions options) : o_(options) {}

  const LrSweepOptions& options() const { return o_; }
  const std::vector<SweepPoint>& points() const { return points_; }
  bool diverged() const { return diverged_; }
  // True when no more steps are wanted (all N done, or the loss diverged).
  bool finished() const { return diverged_ || static_cast<int64_t>(points_.size()) >= o_.num_training_steps_; }

  // The lr of sweep step `k` (0-based).
  double lr_at(int64_t k) const {
    const double n = static_cast<double>(std::max<int64_t>(1, o_.num_training_steps_ - 1));
    const double r = static_cast<double>(k) / n;
    if (o_.mode_ == SweepMode::linear) return o_.min_lr_ + r * (o_.max_lr_ - o_.min_lr_);
    return o_.min_lr_ * std::pow(o_.max_lr_ / o_.min_lr_, r);
  }
  double next_lr() const { return lr_at(static_cast<int64_t>(points_.size())); }

  // Records the loss of the step taken with next_lr(); returns finished().
  bool record(double loss) {
    const double lr = next_lr();
    // A step without a loss (nan) leaves the average alone and is left out of the suggestion.
    double smoothed = std::numeric_limits<double>::quiet_NaN();
    if (!std::isnan(loss)) {
      average_ = o_.beta_ * average_ + (1.0 - o_.beta_) * loss;
      ++seen_;
      smoothed = average_ / (1.0 - std::pow(o_.beta_, static_cast<double>(seen_)));
    }
    // Lightning compares from the second loss on: the first one has nothing to diverge from.
    if (!std::isnan(o_.early_stop_threshold_) && seen_ > 1 && !std::isnan(smoothed) &&
        smoothed > o_.early_stop_threshold_ * best_)
      diverged_ = true;
    if (!std::isnan(smoothed) && (seen_ == 1 || smoothed < best_)) best_ = smoothed;
    points_.push_back({lr, loss, smoothed});
    return finished();
  }

  // The index of the suggested point: the most negative gradient of the smoothed loss, after
  // leaving out the first skip_begin and last skip_end points and any non-finite loss. nullopt
  // when fewer than two points remain (Lightning: "not enough points").
  std::optional<size_t> suggestion_index() const {
    const auto n = static_cast<int64_t>(points_.size());
    std::vector<size_t> kept;
    for (int64_t i = o_.skip_begin_; i < n - o_.skip_end_; ++i)
      if (std::isfinite(points_[static_cast<size_t>(i)].smoothed_loss)) kept.push_back(static_cast<size_t>(i));
    if (kept.size() < 2) return std::nullopt;
    auto x = [&](size_t i) {
      const double lr = points_[kept[i]].lr;
      return o_.mode_ == SweepMode::exponential ? std::log10(lr) : lr;
    };
    auto y = [&](size_t i) { return points_[kept[i]].smoothed_loss; };
    // Second-order central differences on uneven spacing, first order at the ends (as
    // numpy.gradient / torch.gradient with coordinates).
    size_t best = 0;
    double best_gradient = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < kept.size(); ++i) {
      double g;
      if (i == 0) {
        g = (y(1) - y(0)) / (x(1) - x(0));
      } else if (i + 1 == kept.size()) {
        g = (y(i) - y(i - 1)) / (x(i) - x(i - 1));
      } else {
        const double hl = x(i) - x(i - 1), hr = x(i + 1) - x(i);
        g = (hl * hl * y(i + 1) - hr * hr * y(i - 1) + (hr * hr - hl * hl) * y(i)) / (hl * hr * (hl + hr));
      }
      if (g < best_gradient) {
        best_gradient = g;
        best = i;
      }
    }
    return kept[best];
  }

  std::optional<double> suggestion() const {
    auto i = suggestion_index();
    if (!i) return std::nullopt;
    return points_[*i].lr;
  }

 private:
  LrSweepOptions o_;
  std::vector<SweepPoint> points_;
  double average_ = 0.0;
  int64_t seen_ = 0;
  double best_ = 0.0;
  bool diverged_ = false;
};

}  // namespace fulgur::lr_finder
