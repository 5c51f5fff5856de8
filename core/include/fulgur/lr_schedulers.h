// More of PyTorch's learning-rate schedulers (torch.optim.lr_scheduler), with the semantics of
// fulgur/lr_scheduler.h: constructing one applies the step-0 learning rate, each step() advances
// one interval, and the learning rate is a closed form of the step count, so a checkpoint needs
// only the count. Kept apart from lr_scheduler.h, which module.h (and so every model) includes.
#pragma once

#include <fulgur/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

// torch.optim.lr_scheduler.MultiStepLR: lr = base * gamma^(number of milestones <= step).
std::shared_ptr<LRScheduler> make_multi_step_lr(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones,
                                                double gamma = 0.1);
// ExponentialLR: lr = base * gamma^step.
std::shared_ptr<LRScheduler> make_exponential_lr(torch::optim::Optimizer& optimizer, double gamma);
// CosineAnnealingWarmRestarts: cosine from base to eta_min over t_0 steps, then restarts, each
// period t_mult times longer than the last.
std::shared_ptr<LRScheduler> make_cosine_warm_restarts(torch::optim::Optimizer& optimizer, int64_t t_0,
                                                       int64_t t_mult = 1, double eta_min = 0.0);
// PolynomialLR: lr = base * (1 - min(step, total_iters) / total_iters)^power.
std::shared_ptr<LRScheduler> make_polynomial_lr(torch::optim::Optimizer& optimizer, int64_t total_iters = 5,
                                                double power = 1.0);
// CyclicLR (cycle_momentum=False: momentum is not cycled): lr between base_lr and max_lr in
// cycles of step_size_up steps up and step_size_down (0: = step_size_up) down; mode "triangular",
// "triangular2" (amplitude halves every cycle) or "exp_range" (amplitude * gamma^step). The
// optimizer's own lr is replaced by base_lr, as PyTorch does.
std::shared_ptr<LRScheduler> make_cyclic_lr(torch::optim::Optimizer& optimizer, double base_lr, double max_lr,
                                            int64_t step_size_up = 2000, int64_t step_size_down = 0,
                                            const std::string& mode = "triangular", double gamma = 1.0);
// LambdaLR: lr = base * lr_lambda(step). The function must be pure in the step (resume calls it
// with the restored step only).
std::shared_ptr<LRScheduler> make_lambda_lr(torch::optim::Optimizer& optimizer,
                                            std::function<double(int64_t)> lr_lambda);

// Builds a scheduler on an optimizer: what make_sequential_lr and make_chained_lr combine.
using SchedulerFactory = std::function<std::shared_ptr<LRScheduler>(torch::optim::Optimizer&)>;
// SequentialLR: schedulers[i] runs from milestones[i-1] on, restarted at its own step 0 there
// (milestones.size() == schedulers.size() - 1, increasing). Each one is built from the
// optimizer's lrs as they are now (PyTorch's initial_lr). Not with reduce-on-plateau.
std::shared_ptr<LRScheduler> make_sequential_lr(torch::optim::Optimizer& optimizer,
                                                const std::vector<SchedulerFactory>& schedulers,
                                                std::vector<int64_t> milestones);
// ChainedScheduler: every scheduler steps each time; their factors lr/base multiply. Equal to
// PyTorch's for multiplicative schedules (step, multi-step, exponential, polynomial, lambda
// factors); PyTorch's recursive cosine forms chained with others are not reproduced.
std::shared_ptr<LRScheduler> make_chained_lr(torch::optim::Optimizer& optimizer,
                                             const std::vector<SchedulerFactory>& schedulers);

/// Lightning's lr-scheduler-dict keys that OptimizerConfig does not hold (its layout is frozen).
struct SchedulerKeys {
  /// What the scheduler is called: Lightning's `name`, the key lr_monitor logs its learning rate
  /// under ("" = "lr-<Optimizer>"); the Trainer's messages about the scheduler say it.
  std::string name;
  /// Lightning's `strict`: with a `monitor` that has not been logged when the scheduler is due,
  /// true stops the run with an error, false warns and skips that step of the schedule.
  bool strict = true;
};

/// A scheduler that carries SchedulerKeys: it steps, checkpoints and resumes as the one it wraps
/// (same state, so a checkpoint of either loads into the other). Made by with_scheduler_keys.
class KeyedLRScheduler final : public LRScheduler {
 public:
  /// `optimizer` is the one `scheduler` was built on.
  KeyedLRScheduler(torch::optim::Optimizer& optimizer, std::shared_ptr<LRScheduler> scheduler, SchedulerKeys keys);
  void step() override;
  void step(double metric) override;
  std::vector<double> state() const override;
  void load_state(const std::vector<double>& state) override;
  /// The keys given.
  const SchedulerKeys& keys() const { return keys_; }
  /// The scheduler wrapped.
  const std::shared_ptr<LRScheduler>& scheduler() const { return scheduler_; }

 protected:
  std::vector<double> lrs_at(int64_t step) const override;

 private:
  std::shared_ptr<LRScheduler> scheduler_;
  SchedulerKeys keys_;
};

/// `scheduler` (built on `optimizer`) with Lightning's `name` and `strict`:
///
///   OptimizerConfig(sgd).with_scheduler(
///       with_scheduler_keys(*sgd, make_reduce_on_plateau(*sgd), {.name = "plateau", .strict = false}),
///       SchedulerInterval::epoch, 1, "val/loss");
std::shared_ptr<LRScheduler> with_scheduler_keys(torch::optim::Optimizer& optimizer,
                                                 std::shared_ptr<LRScheduler> scheduler, SchedulerKeys keys);

/// The SchedulerKeys of `scheduler`: those with_scheduler_keys gave it, else the defaults
/// (no name, strict), as Lightning's.
SchedulerKeys scheduler_keys(const LRScheduler& scheduler);

}  // namespace fulgur
