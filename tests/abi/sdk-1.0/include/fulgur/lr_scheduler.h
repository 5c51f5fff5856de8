// Learning-rate schedulers with PyTorch's Python semantics: constructing a scheduler applies the
// step-0 learning rate, and each step() advances one interval (C++'s torch::optim::StepLR lags
// Python by one step; these do not). Closed-form schedules compute lr from the step count, so
// resuming only needs the count.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class LRScheduler {
 public:
  explicit LRScheduler(torch::optim::Optimizer& optimizer);
  virtual ~LRScheduler();

  // One interval (step or epoch, as configured in OptimizerConfig).
  virtual void step();
  // For schedulers driven by a monitored metric (reduce-on-plateau); others ignore the metric.
  virtual void step(double metric);
  std::vector<double> last_lr() const;
  int64_t step_count() const { return last_step_; }

  // Checkpoint state: step count and whatever the schedule adds; restores lrs on load.
  virtual std::vector<double> state() const;
  virtual void load_state(const std::vector<double>& state);

 protected:
  // Learning rate of each param group at `step` (closed form from base lrs).
  virtual std::vector<double> lrs_at(int64_t step) const = 0;
  void apply(const std::vector<double>& lrs);
  void initialize();  // derived constructors call this once their parameters are set

  torch::optim::Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  int64_t last_step_ = 0;
};

// lr = base * gamma^(step / step_size)
std::shared_ptr<LRScheduler> make_step_lr(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
// Linear warm-up from warmup_start_factor*base to base over warmup_steps, then cosine down to
// eta_min at total_steps.
std::shared_ptr<LRScheduler> make_cosine_with_warmup(torch::optim::Optimizer& optimizer, int64_t warmup_steps,
                                                     int64_t total_steps, double eta_min = 0.0,
                                                     double warmup_start_factor = 0.0);
// Linear warm-up over warmup_steps, then linear decay to end_factor*base at total_steps.
std::shared_ptr<LRScheduler> make_linear_warmup_decay(torch::optim::Optimizer& optimizer, int64_t warmup_steps,
                                                      int64_t total_steps, double end_factor = 0.0);
// PyTorch's OneCycleLR (cosine annealing, two phases): max_lr per group = base lr.
std::shared_ptr<LRScheduler> make_one_cycle(torch::optim::Optimizer& optimizer, int64_t total_steps,
                                            double pct_start = 0.3, double div_factor = 25.0,
                                            double final_div_factor = 1e4);
// ReduceLROnPlateau: multiply lr by factor after `patience` non-improving steps (mode "min"/"max").
std::shared_ptr<LRScheduler> make_reduce_on_plateau(torch::optim::Optimizer& optimizer, bool mode_max = false,
                                                    double factor = 0.1, int64_t patience = 10, double threshold = 1e-4,
                                                    double min_lr = 0.0);

}  // namespace fulgur
