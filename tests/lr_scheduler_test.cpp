// LR schedulers follow PyTorch's Python semantics (values below were produced by torch 2.11's
// torch.optim.lr_scheduler with the same arguments), unlike LibTorch's StepLR which lags a step.
#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>
#include <fulgur/lr_scheduler.h>
#include <fulgur/lr_schedulers.h>

#include <doctest/doctest.h>
#include <torch/optim/sgd.h>

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <numbers>

#include "test_support.h"

namespace {

std::vector<double> run(const std::function<std::shared_ptr<fulgur::LRScheduler>(torch::optim::Optimizer&)>& make,
                        int steps, const std::vector<double>& metrics = {}) {
  std::vector<at::Tensor> params{at::zeros({1}).requires_grad_()};
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1));
  auto scheduler = make(optimizer);
  std::vector<double> lrs{optimizer.param_groups()[0].options().get_lr()};
  for (int i = 0; i < steps; ++i) {
    if (metrics.empty())
      scheduler->step();
    else
      scheduler->step(metrics[static_cast<size_t>(i)]);
    lrs.push_back(optimizer.param_groups()[0].options().get_lr());
  }
  return lrs;
}

void check_close(const std::vector<double>& actual, const std::vector<double>& expected) {
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    INFO("step " << i);
    CHECK(actual[i] == doctest::Approx(expected[i]).epsilon(1e-9));
  }
}

}  // namespace

TEST_CASE("step lr matches torch.optim.lr_scheduler.StepLR") {
  check_close(run([](auto& o) { return fulgur::make_step_lr(o, 2, 0.5); }, 5), {0.1, 0.1, 0.05, 0.05, 0.025, 0.025});
}

TEST_CASE("one-cycle matches torch's OneCycleLR (cos, two phases)") {
  check_close(run([](auto& o) { return fulgur::make_one_cycle(o, 10); }, 9),
              {0.0040000000000000036, 0.052000000000000005, 0.1, 0.09504846320134738, 0.0811745653949763,
               0.06112620219362893, 0.03887419780637107, 0.0188258346050237, 0.004951936798652629, 4e-07});
}

TEST_CASE("reduce-on-plateau matches torch's ReduceLROnPlateau and needs a metric") {
  check_close(run([](auto& o) { return fulgur::make_reduce_on_plateau(o, false, 0.5, 1); }, 6,
                  {1.0, 0.9, 0.95, 0.95, 0.8, 0.85}),
              {0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05});
  CHECK_THROWS_AS(run([](auto& o) { return fulgur::make_reduce_on_plateau(o); }, 1), fulgur::Error);
}

TEST_CASE("cosine with warmup and linear warmup/decay follow their closed forms") {
  auto cosine = run([](auto& o) { return fulgur::make_cosine_with_warmup(o, 2, 6, 0.0, 0.0); }, 6);
  CHECK(cosine[0] == doctest::Approx(0.0));
  CHECK(cosine[1] == doctest::Approx(0.05));
  CHECK(cosine[2] == doctest::Approx(0.1));
  CHECK(cosine[4] == doctest::Approx(0.1 * 0.5 * (1 + std::cos(std::numbers::pi * 0.5))));
  CHECK(cosine[6] == doctest::Approx(0.0));
  auto linear = run([](auto& o) { return fulgur::make_linear_warmup_decay(o, 1, 5, 0.0); }, 5);
  CHECK(linear[0] == doctest::Approx(0.05));
  CHECK(linear[1] == doctest::Approx(0.1));
  CHECK(linear[5] == doctest::Approx(0.0));
  CHECK(linear[3] == doctest::Approx(0.05));
}

TEST_CASE("scheduler state round-trips: a restored scheduler continues where it stopped") {
  std::vector<at::Tensor> params{at::zeros({1}).requires_grad_()};
  torch::optim::SGD a(params, torch::optim::SGDOptions(0.1)), b(params, torch::optim::SGDOptions(0.1));
  auto sa = fulgur::make_step_lr(a, 2, 0.5), sb = fulgur::make_step_lr(b, 2, 0.5);
  for (int i = 0; i < 3; ++i) sa->step();
  sb->load_state(sa->state());
  CHECK(b.param_groups()[0].options().get_lr() == doctest::Approx(0.05));
  sa->step();
  sb->step();
  CHECK(b.param_groups()[0].options().get_lr() == doctest::Approx(a.param_groups()[0].options().get_lr()));
}

// ---- the schedulers of fulgur/lr_schedulers.h against torch.optim.lr_scheduler, run in Python ----

namespace {

constexpr int kPySteps = 40;

struct PyCase {
  std::string name;    // also the key of the Python result
  std::string python;  // builds the scheduler on `opt` (SGD, lr 0.1, no momentum)
  std::function<std::shared_ptr<fulgur::LRScheduler>(torch::optim::Optimizer&)> make;
};

std::vector<PyCase> py_cases() {
  using fulgur::SchedulerFactory;
  return {
      {"multi_step", "L.MultiStepLR(opt, milestones=[3, 7, 7, 12], gamma=0.5)",
       [](auto& o) {
         return fulgur::make_multi_step_lr(o, {3, 7, 7, 12}, 0.5);
       }},
      {"exponential", "L.ExponentialLR(opt, gamma=0.9)", [](auto& o) { return fulgur::make_exponential_lr(o, 0.9); }},
      {"warm_restarts", "L.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=0.001)",
       [](auto& o) { return fulgur::make_cosine_warm_restarts(o, 3, 2, 0.001); }},
      {"warm_restarts_1", "L.CosineAnnealingWarmRestarts(opt, T_0=5)",
       [](auto& o) { return fulgur::make_cosine_warm_restarts(o, 5); }},
      {"polynomial", "L.PolynomialLR(opt, total_iters=25, power=2.0)",
       [](auto& o) { return fulgur::make_polynomial_lr(o, 25, 2.0); }},
      {"cyclic", "L.CyclicLR(opt, 0.01, 0.1, step_size_up=4, step_size_down=6, cycle_momentum=False)",
       [](auto& o) { return fulgur::make_cyclic_lr(o, 0.01, 0.1, 4, 6); }},
      {"cyclic2", "L.CyclicLR(opt, 0.01, 0.1, step_size_up=3, mode='triangular2', cycle_momentum=False)",
       [](auto& o) { return fulgur::make_cyclic_lr(o, 0.01, 0.1, 3, 0, "triangular2"); }},
      {"cyclic_exp", "L.CyclicLR(opt, 0.01, 0.1, step_size_up=5, mode='exp_range', gamma=0.97, cycle_momentum=False)",
       [](auto& o) { return fulgur::make_cyclic_lr(o, 0.01, 0.1, 5, 0, "exp_range", 0.97); }},
      {"lambda", "L.LambdaLR(opt, lambda s: 1.0 / (1 + s) ** 0.5)",
       [](auto& o) { return fulgur::make_lambda_lr(o, [](int64_t s) { return 1.0 / std::pow(1.0 + s, 0.5); }); }},
      {"sequential",
       "L.SequentialLR(opt, [L.ExponentialLR(opt, gamma=0.8), L.MultiStepLR(opt, [4, 8], 0.5), "
       "L.CosineAnnealingWarmRestarts(opt, T_0=6)], milestones=[5, 15])",
       [](auto& o) {
         return fulgur::make_sequential_lr(o,
                                           {[](auto& p) { return fulgur::make_exponential_lr(p, 0.8); },
                                            [](auto& p) {
                                              return fulgur::make_multi_step_lr(p, {4, 8}, 0.5);
                                            },
                                            [](auto& p) { return fulgur::make_cosine_warm_restarts(p, 6); }},
                                           {5, 15});
       }},
      {"chained", "L.ChainedScheduler([L.MultiStepLR(opt, [3, 9], 0.5), L.ExponentialLR(opt, gamma=0.95)])",
       [](auto& o) {
         return fulgur::make_chained_lr(o, {[](auto& p) {
                                              return fulgur::make_multi_step_lr(p, {3, 9}, 0.5);
                                            },
                                            [](auto& p) { return fulgur::make_exponential_lr(p, 0.95); }});
       }},
  };
}

}  // namespace

TEST_CASE("multi-step, exponential, warm restarts, polynomial, cyclic, lambda, sequential, chained equal PyTorch") {
  fulgur::test::TempDir dir;
  const auto cases = py_cases();
  std::string script = fmt::format(R"(
import sys, warnings, torch
import torch.optim.lr_scheduler as L
warnings.filterwarnings("ignore")
out = {{}}
def run(name, make):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = make(opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range({}):
        opt.step()
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    out[name] = torch.tensor(lrs, dtype=torch.float64)
)",
                                   kPySteps);
  for (const auto& c : cases) script += fmt::format("run({:?}, lambda opt: {})\n", c.name, c.python);
  script += "torch.save(out, sys.argv[1])\nprint('python-ok')\n";
  std::ofstream(dir / "schedulers.py") << script;
  const auto [status, output] = fulgur::test::run_command(fmt::format(
      "{} {} {} 2>&1", FULGUR_TEST_PYTHON, (dir / "schedulers.py").string(), (dir / "expected.pt").string()));
  INFO(output);
  REQUIRE(status == 0);
  const auto expected = fulgur::read_checkpoint_file((dir / "expected.pt").string()).toGenericDict();
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const at::Tensor theirs = expected.at(c.name).toTensor();
    const auto ours = run(c.make, kPySteps);
    REQUIRE(static_cast<int64_t>(ours.size()) == theirs.numel());
    for (size_t i = 0; i < ours.size(); ++i) {
      INFO("step " << i);
      CHECK(ours[i] == doctest::Approx(theirs[static_cast<int64_t>(i)].item<double>()).epsilon(1e-9));
    }
    // Resume: a scheduler restored from step 17's state continues with the same values.
    std::vector<at::Tensor> params{at::zeros({1}).requires_grad_()};
    torch::optim::SGD a(params, torch::optim::SGDOptions(0.1)), b(params, torch::optim::SGDOptions(0.1));
    auto sa = c.make(a), sb = c.make(b);
    for (int i = 0; i < 17; ++i) sa->step();
    sb->load_state(sa->state());
    for (int i = 17; i < kPySteps; ++i) {
      sa->step();
      sb->step();
      CHECK(b.param_groups()[0].options().get_lr() == a.param_groups()[0].options().get_lr());
    }
  }
}

TEST_CASE("combined schedulers refuse reduce-on-plateau and mismatched milestones") {
  std::vector<at::Tensor> params{at::zeros({1}).requires_grad_()};
  torch::optim::SGD o(params, torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(
      fulgur::make_sequential_lr(o, {[](auto& p) { return fulgur::make_exponential_lr(p, 0.9); }}, {3}),
      doctest::Contains("expected 0 milestones for 1 schedulers"), fulgur::Error);
  CHECK_THROWS_WITH_AS(fulgur::make_chained_lr(o, {[](auto& p) { return fulgur::make_reduce_on_plateau(p); }}),
                       doctest::Contains("cannot be combined"), fulgur::Error);
  // The children were built from lr 0.1 and the optimizer is left at it.
  CHECK(o.param_groups()[0].options().get_lr() == 0.1);
}
