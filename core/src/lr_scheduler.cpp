#include <fulgur/error.h>
#include <fulgur/lr_scheduler.h>
#include <fulgur/lr_schedulers.h>

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

class MultiStepLR final : public LRScheduler {
 public:
  MultiStepLR(torch::optim::Optimizer& o, std::vector<int64_t> milestones, double gamma)
      : LRScheduler(o), milestones_(std::move(milestones)), gamma_(gamma) {
    std::sort(milestones_.begin(), milestones_.end());
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), step) - milestones_.begin();
    std::vector<double> out;
    for (double base : base_lrs_) out.push_back(base * std::pow(gamma_, static_cast<double>(passed)));
    return out;
  }

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
};

class ExponentialLR final : public LRScheduler {
 public:
  ExponentialLR(torch::optim::Optimizer& o, double gamma) : LRScheduler(o), gamma_(gamma) { initialize(); }
  std::vector<double> lrs_at(int64_t step) const override {
    std::vector<double> out;
    for (double base : base_lrs_) out.push_back(base * std::pow(gamma_, static_cast<double>(step)));
    return out;
  }

 private:
  double gamma_;
};

// PyTorch's recursive T_cur/T_i bookkeeping, replayed from step 0 (cheap: integers).
class CosineWarmRestarts final : public LRScheduler {
 public:
  CosineWarmRestarts(torch::optim::Optimizer& o, int64_t t_0, int64_t t_mult, double eta_min)
      : LRScheduler(o), t_0_(t_0), t_mult_(t_mult), eta_min_(eta_min) {
    if (t_0 <= 0) throw Error(ErrorKind::invalid_argument, "cosine warm restarts: t_0 must be a positive integer");
    if (t_mult < 1) throw Error(ErrorKind::invalid_argument, "cosine warm restarts: t_mult must be an integer >= 1");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    int64_t t_cur = 0, t_i = t_0_;
    if (t_mult_ == 1) {
      t_cur = step % t_0_;
    } else {
      for (int64_t s = 0; s < step; ++s)
        if (++t_cur >= t_i) {
          t_cur -= t_i;
          t_i *= t_mult_;
        }
    }
    std::vector<double> out;
    for (double base : base_lrs_)
      out.push_back(eta_min_ +
                    (base - eta_min_) *
                        (1 + std::cos(std::numbers::pi * static_cast<double>(t_cur) / static_cast<double>(t_i))) / 2);
    return out;
  }

 private:
  int64_t t_0_, t_mult_;
  double eta_min_;
};

class PolynomialLR final : public LRScheduler {
 public:
  PolynomialLR(torch::optim::Optimizer& o, int64_t total_iters, double power)
      : LRScheduler(o), total_iters_(total_iters), power_(power) {
    if (total_iters <= 0) throw Error(ErrorKind::invalid_argument, "polynomial lr: total_iters must be positive");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    const double progress = static_cast<double>(std::min(step, total_iters_)) / static_cast<double>(total_iters_);
    std::vector<double> out;
    for (double base : base_lrs_) out.push_back(base * std::pow(1.0 - progress, power_));
    return out;
  }

 private:
  int64_t total_iters_;
  double power_;
};

// torch.optim.lr_scheduler.CyclicLR.get_lr, without the momentum cycle.
class CyclicLR final : public LRScheduler {
 public:
  CyclicLR(torch::optim::Optimizer& o, double base_lr, double max_lr, int64_t up, int64_t down, std::string mode,
           double gamma)
      : LRScheduler(o), base_lr_(base_lr), max_lr_(max_lr), mode_(std::move(mode)), gamma_(gamma) {
    if (up <= 0 || down < 0)
      throw Error(ErrorKind::invalid_argument, "cyclic lr: step_size_up must be positive, step_size_down >= 0");
    if (mode_ != "triangular" && mode_ != "triangular2" && mode_ != "exp_range")
      throw Error(ErrorKind::invalid_argument,
                  "cyclic lr: mode '" + mode_ + "' is not one of \"triangular\", \"triangular2\", \"exp_range\"");
    const double up_d = static_cast<double>(up), down_d = down == 0 ? up_d : static_cast<double>(down);
    total_size_ = up_d + down_d;
    step_ratio_ = up_d / total_size_;
    for (double& base : base_lrs_) base = base_lr_;
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    const double s = static_cast<double>(step);
    const double cycle = std::floor(1 + s / total_size_);
    const double x = 1.0 + s / total_size_ - cycle;
    const double scale_factor = x <= step_ratio_ ? x / step_ratio_ : (x - 1) / (step_ratio_ - 1);
    const double base_height = (max_lr_ - base_lr_) * scale_factor;
    double scale = 1.0;
    if (mode_ == "triangular2")
      scale = 1 / std::pow(2.0, cycle - 1);
    else if (mode_ == "exp_range")
      scale = std::pow(gamma_, s);
    return std::vector<double>(base_lrs_.size(), base_lr_ + base_height * scale);
  }

 private:
  double base_lr_, max_lr_;
  std::string mode_;
  double gamma_;
  double total_size_ = 0, step_ratio_ = 0;
};

class LambdaLR final : public LRScheduler {
 public:
  LambdaLR(torch::optim::Optimizer& o, std::function<double(int64_t)> f) : LRScheduler(o), f_(std::move(f)) {
    if (!f_) throw Error(ErrorKind::invalid_argument, "lambda lr: lr_lambda is empty");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    const double factor = f_(step);
    std::vector<double> out;
    for (double base : base_lrs_) out.push_back(base * factor);
    return out;
  }

 private:
  std::function<double(int64_t)> f_;
};

// Builds each child from the optimizer's current lrs (PyTorch's initial_lr), restoring them after.
std::vector<std::shared_ptr<LRScheduler>> build_children(torch::optim::Optimizer& o,
                                                         const std::vector<SchedulerFactory>& factories,
                                                         const char* who) {
  if (factories.empty()) throw Error(ErrorKind::invalid_argument, std::string(who) + ": no schedulers given");
  std::vector<double> initial;
  for (auto& group : o.param_groups()) initial.push_back(group.options().get_lr());
  auto restore = [&] {
    for (size_t i = 0; i < initial.size(); ++i) o.param_groups()[i].options().set_lr(initial[i]);
  };
  std::vector<std::shared_ptr<LRScheduler>> children;
  for (const auto& make : factories) {
    restore();
    auto child = make(o);
    if (!child) throw Error(ErrorKind::invalid_argument, std::string(who) + ": a factory returned no scheduler");
    if (dynamic_cast<ReduceOnPlateau*>(child.get()))
      throw Error(ErrorKind::invalid_argument,
                  std::string(who) + ": reduce-on-plateau steps on a metric, not a schedule; it cannot be combined");
    children.push_back(std::move(child));
  }
  restore();
  return children;
}

// Both combinations call their children's closed forms: the pointer to the protected member is
// taken through this class (the standard's way for a derived class to reach it on a sibling).
class Combined : public LRScheduler {
 protected:
  Combined(torch::optim::Optimizer& o, std::vector<std::shared_ptr<LRScheduler>> children)
      : LRScheduler(o), children_(std::move(children)) {}
  static std::vector<double> child_lrs(const LRScheduler& child, int64_t step) {
    return (child.*(&Combined::lrs_at))(step);
  }
  std::vector<std::shared_ptr<LRScheduler>> children_;
};

class SequentialLR final : public Combined {
 public:
  SequentialLR(torch::optim::Optimizer& o, const std::vector<SchedulerFactory>& factories,
               std::vector<int64_t> milestones)
      : Combined(o, build_children(o, factories, "sequential lr")), milestones_(std::move(milestones)) {
    if (milestones_.size() + 1 != children_.size())
      throw Error(ErrorKind::invalid_argument, "sequential lr: expected " + std::to_string(children_.size() - 1) +
                                                   " milestones for " + std::to_string(children_.size()) +
                                                   " schedulers, got " + std::to_string(milestones_.size()));
    if (!std::is_sorted(milestones_.begin(), milestones_.end()))
      throw Error(ErrorKind::invalid_argument, "sequential lr: milestones must increase");
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    const auto i = std::upper_bound(milestones_.begin(), milestones_.end(), step) - milestones_.begin();
    const int64_t local = i == 0 ? step : step - milestones_[static_cast<size_t>(i - 1)];
    return child_lrs(*children_[static_cast<size_t>(i)], local);
  }

 private:
  std::vector<int64_t> milestones_;
};

class ChainedLR final : public Combined {
 public:
  ChainedLR(torch::optim::Optimizer& o, const std::vector<SchedulerFactory>& factories)
      : Combined(o, build_children(o, factories, "chained lr")) {
    initialize();
  }
  std::vector<double> lrs_at(int64_t step) const override {
    std::vector<double> out = base_lrs_;
    for (const auto& child : children_) {
      const std::vector<double> lrs = child_lrs(*child, step);
      for (size_t g = 0; g < out.size() && g < lrs.size(); ++g)
        out[g] = base_lrs_[g] == 0 ? 0 : out[g] * (lrs[g] / base_lrs_[g]);
    }
    return out;
  }
};

}  // namespace

std::shared_ptr<LRScheduler> make_multi_step_lr(torch::optim::Optimizer& o, std::vector<int64_t> milestones,
                                                double gamma) {
  return std::make_shared<MultiStepLR>(o, std::move(milestones), gamma);
}
std::shared_ptr<LRScheduler> make_exponential_lr(torch::optim::Optimizer& o, double gamma) {
  return std::make_shared<ExponentialLR>(o, gamma);
}
std::shared_ptr<LRScheduler> make_cosine_warm_restarts(torch::optim::Optimizer& o, int64_t t_0, int64_t t_mult,
                                                       double eta_min) {
  return std::make_shared<CosineWarmRestarts>(o, t_0, t_mult, eta_min);
}
std::shared_ptr<LRScheduler> make_polynomial_lr(torch::optim::Optimizer& o, int64_t total_iters, double power) {
  return std::make_shared<PolynomialLR>(o, total_iters, power);
}
std::shared_ptr<LRScheduler> make_cyclic_lr(torch::optim::Optimizer& o, double base_lr, double max_lr, int64_t up,
                                            int64_t down, const std::string& mode, double gamma) {
  return std::make_shared<CyclicLR>(o, base_lr, max_lr, up, down, mode, gamma);
}
std::shared_ptr<LRScheduler> make_lambda_lr(torch::optim::Optimizer& o, std::function<double(int64_t)> lr_lambda) {
  return std::make_shared<LambdaLR>(o, std::move(lr_lambda));
}
std::shared_ptr<LRScheduler> make_sequential_lr(torch::optim::Optimizer& o, const std::vector<SchedulerFactory>& s,
                                                std::vector<int64_t> milestones) {
  return std::make_shared<SequentialLR>(o, s, std::move(milestones));
}
std::shared_ptr<LRScheduler> make_chained_lr(torch::optim::Optimizer& o, const std::vector<SchedulerFactory>& s) {
  return std::make_shared<ChainedLR>(o, s);
}

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

// ---- SchedulerKeys ----------------------------------------------------------------------------

KeyedLRScheduler::KeyedLRScheduler(torch::optim::Optimizer& optimizer, std::shared_ptr<LRScheduler> scheduler,
                                   SchedulerKeys keys)
    : LRScheduler(optimizer), scheduler_(std::move(scheduler)), keys_(std::move(keys)) {
  if (!scheduler_) throw Error(ErrorKind::invalid_argument, "with_scheduler_keys: the scheduler is null");
  last_step_ = scheduler_->step_count();
}

// Forwarded whole (never through lrs_at): the wrapped scheduler may be driven by a metric.
void KeyedLRScheduler::step() {
  scheduler_->step();
  last_step_ = scheduler_->step_count();
}
void KeyedLRScheduler::step(double metric) {
  scheduler_->step(metric);
  last_step_ = scheduler_->step_count();
}
std::vector<double> KeyedLRScheduler::state() const { return scheduler_->state(); }
void KeyedLRScheduler::load_state(const std::vector<double>& state) {
  scheduler_->load_state(state);
  last_step_ = scheduler_->step_count();
}
std::vector<double> KeyedLRScheduler::lrs_at(int64_t) const { return scheduler_->last_lr(); }

std::shared_ptr<LRScheduler> with_scheduler_keys(torch::optim::Optimizer& optimizer,
                                                 std::shared_ptr<LRScheduler> scheduler, SchedulerKeys keys) {
  return std::make_shared<KeyedLRScheduler>(optimizer, std::move(scheduler), std::move(keys));
}

SchedulerKeys scheduler_keys(const LRScheduler& scheduler) {
  if (const auto* keyed = dynamic_cast<const KeyedLRScheduler*>(&scheduler)) return keyed->keys();
  return {};
}

}  // namespace fulgur
