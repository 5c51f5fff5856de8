#include <fulgur/error.h>
#include <fulgur/lr_scheduler.h>

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace fulgur {

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {
  for (auto& group : optimizer_.param_groups()) base_lrs_.push_back(group.options().get_lr());
}
LRScheduler::~LRScheduler() = default;

void LRScheduler::initialize() { apply(lrs_at(0)); }

void LRScheduler::apply(const std::vector<double>& lrs) {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < lrs.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

void LRScheduler::step() {
  ++last_step_;
  apply(lrs_at(last_step_));
}
void LRScheduler::step(double) { step(); }

std::vector<double> LRScheduler::last_lr() const {
  std::vector<double> out;
  for (auto& group : optimizer_.param_groups()) out.push_back(group.options().get_lr());
  return out;
}

std::vector<double> LRScheduler::state() const { return {static_cast<double>(last_step_)}; }
void LRScheduler::load_state(const std::vector<double>& state) {
  if (state.empty()) throw Error(ErrorKind::checkpoint, "lr scheduler state is empty");
  last_step_ = static_cast<int64_t>(state[0]);
  apply(lrs_at(last_step_));
}

namespace {

class StepLR final : public LRScheduler {
 public:
  StepLR(torch::optim::Optimizer& o, int64_t step_size, double gamma)
      : LRScheduler(o), step_size_(step_size), gamma_(gamma) {
    if (step_size <= 0) throw Error(ErrorKind::invalid_argument, "StepLR: step_size must be positive");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    std::vector<double> out;
    for (double base : base_lrs_) out.push_back(base * std::pow(gamma_, static_cast<double>(step / step_size_)));
    return out;
  }

 private:
  int64_t step_size_;
  double gamma_;
};

class CosineWithWarmup final : public LRScheduler {
 public:
  CosineWithWarmup(torch::optim::Optimizer& o, int64_t warmup, int64_t total, double eta_min, double start_factor)
      : LRScheduler(o), warmup_(warmup), total_(total), eta_min_(eta_min), start_factor_(start_factor) {
    if (total <= 0 || warmup < 0 || warmup > total)
      throw Error(ErrorKind::invalid_argument, "cosine schedule: need 0 <= warmup_steps <= total_steps, total > 0");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    std::vector<double> out;
    for (double base : base_lrs_) {
      if (step < warmup_) {
        const double f =
            start_factor_ + (1.0 - start_factor_) * static_cast<double>(step) / static_cast<double>(warmup_);
        out.push_back(base * f);
      } else {
        const double progress = std::min(
            1.0, static_cast<double>(step - warmup_) / static_cast<double>(std::max<int64_t>(1, total_ - warmup_)));
        out.push_back(eta_min_ + (base - eta_min_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
      }
    }
    return out;
  }

 private:
  int64_t warmup_, total_;
  double eta_min_, start_factor_;
};

class LinearWarmupDecay final : public LRScheduler {
 public:
  LinearWarmupDecay(torch::optim::Optimizer& o, int64_t warmup, int64_t total, double end_factor)
      : LRScheduler(o), warmup_(warmup), total_(total), end_factor_(end_factor) {
    if (total <= 0 || warmup < 0 || warmup > total)
      throw Error(ErrorKind::invalid_argument, "linear schedule: need 0 <= warmup_steps <= total_steps, total > 0");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    std::vector<double> out;
    for (double base : base_lrs_) {
      double f;
      if (step < warmup_)
        f = static_cast<double>(step + 1) / static_cast<double>(warmup_ + 1);
      else {
        const double progress = std::min(
            1.0, static_cast<double>(step - warmup_) / static_cast<double>(std::max<int64_t>(1, total_ - warmup_)));
        f = 1.0 + (end_factor_ - 1.0) * progress;
      }
      out.push_back(base * f);
    }
    return out;
  }

 private:
  int64_t warmup_, total_;
  double end_factor_;
};

// torch.optim.lr_scheduler.OneCycleLR with anneal_strategy="cos", three_phase=False.
class OneCycle final : public LRScheduler {
 public:
  OneCycle(torch::optim::Optimizer& o, int64_t total, double pct_start, double div, double final_div)
      : LRScheduler(o), total_(total), pct_start_(pct_start), div_(div), final_div_(final_div) {
    if (total <= 1) throw Error(ErrorKind::invalid_argument, "one-cycle schedule: total_steps must be > 1");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    const double phase1_end = pct_start_ * static_cast<double>(total_) - 1.0;
    const double phase2_end = static_cast<double>(total_) - 1.0;
    auto cos_anneal = [](double start, double end, double pct) {
      return end + (start - end) / 2.0 * (std::cos(std::numbers::pi * pct) + 1.0);
    };
    std::vector<double> out;
    for (double max_lr : base_lrs_) {
      const double initial = max_lr / div_;
      const double min_lr = initial / final_div_;
      const double s = static_cast<double>(step);
      if (s <= phase1_end)
        out.push_back(cos_anneal(initial, max_lr, s / phase1_end));
      else
        out.push_back(cos_anneal(max_lr, min_lr, std::min(1.0, (s - phase1_end) / (phase2_end - phase1_end))));
    }
    return out;
  }

 private:
  int64_t total_;
  double pct_start_, div_, final_div_;
};

class ReduceOnPlateau final : public LRScheduler {
 public:
  ReduceOnPlateau(torch::optim::Optimizer& o, bool mode_max, double factor, int64_t patience, double threshold,
                  double min_lr)
      : LRScheduler(o),
        mode_max_(mode_max),
        factor_(factor),
        patience_(patience),
        threshold_(threshold),
        min_lr_(min_lr) {
    if (factor >= 1.0) throw Error(ErrorKind::invalid_argument, "reduce-on-plateau: factor must be < 1");
    best_ = mode_max ? -INFINITY : INFINITY;
  }
  void step() override {
    throw Error(ErrorKind::invalid_argument,
                "reduce-on-plateau needs a monitored metric: set OptimizerConfig::monitor to a logged metric");
  }
  // Python semantics, threshold_mode "rel".
  void step(double metric) override {
    ++last_step_;
    const bool better = mode_max_ ? metric > best_ * (1.0 + threshold_) : metric < best_ * (1.0 - threshold_);
    if (better) {
      best_ = metric;
      bad_steps_ = 0;
    } else if (++bad_steps_ > patience_) {
      auto lrs = last_lr();
      for (double& lr : lrs) lr = std::max(lr * factor_, min_lr_);
      apply(lrs);
      bad_steps_ = 0;
    }
  }
  std::vector<double> state() const override {
    std::vector<double> s{static_cast<double>(last_step_), best_, static_cast<double>(bad_steps_)};
    for (double lr : last_lr()) s.push_back(lr);
    return s;
  }
  void load_state(const std::vector<double>& s) override {
    if (s.size() < 3) throw Error(ErrorKind::checkpoint, "reduce-on-plateau state is truncated");
    last_step_ = static_cast<int64_t>(s[0]);
    best_ = s[1];
    bad_steps_ = static_cast<int64_t>(s[2]);
    apply(std::vector<double>(s.begin() + 3, s.end()));
  }
  std::vector<double> lrs_at(int64_t) const override { return last_lr(); }

 private:
  bool mode_max_;
  double factor_;
  int64_t patience_;
  double threshold_, min_lr_;
  double best_;
  int64_t bad_steps_ = 0;
};

}  // namespace

std::shared_ptr<LRScheduler> make_step_lr(torch::optim::Optimizer& o, int64_t step_size, double gamma) {
  return std::make_shared<StepLR>(o, step_size, gamma);
}
std::shared_ptr<LRScheduler> make_cosine_with_warmup(torch::optim::Optimizer& o, int64_t warmup, int64_t total,
                                                     double eta_min, double start_factor) {
  return std::make_shared<CosineWithWarmup>(o, warmup, total, eta_min, start_factor);
}
std::shared_ptr<LRScheduler> make_linear_warmup_decay(torch::optim::Optimizer& o, int64_t warmup, int64_t total,
                                                      double end_factor) {
  return std::make_shared<LinearWarmupDecay>(o, warmup, total, end_factor);
}
std::shared_ptr<LRScheduler> make_one_cycle(torch::optim::Optimizer& o, int64_t total, double pct_start, double div,
                                            double final_div) {
  return std::make_shared<OneCycle>(o, total, pct_start, div, final_div);
}
std::shared_ptr<LRScheduler> make_reduce_on_plateau(torch::optim::Optimizer& o, bool mode_max, double factor,
                                                    int64_t patience, double threshold, double min_lr) {
  return std::make_shared<ReduceOnPlateau>(o, mode_max, factor, patience, threshold, min_lr);
}

}  // namespace fulgur
