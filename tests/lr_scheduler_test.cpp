// LR schedulers follow PyTorch's Python semantics (values below were produced by torch 2.11's
// torch.optim.lr_scheduler with the same arguments), unlike LibTorch's StepLR which lags a step.
#include <fulgur/error.h>
#include <fulgur/lr_scheduler.h>

#include <doctest/doctest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>
#include <numbers>

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
