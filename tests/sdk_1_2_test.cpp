// SDK 1.2, what it added without changing a frozen vtable or layout (CHANGELOG.md):
// - fulgur::nn::BatchNorm (fulgur/nn/batch_norm.h): in one process it is torch::nn::BatchNorm1d,
//   2d and 3d, checked here against them value for value, gradient for gradient, and name for
//   name; synchronized across ranks by [trainer] sync_batchnorm, checked in distributed_test.cpp
//   (2 ranks with batch B train as one process with batch 2B).
#include <fulgur/error.h>
#include <fulgur/nn/batch_norm.h>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <set>
#include <string>

namespace {

std::set<std::string> names(const torch::OrderedDict<std::string, at::Tensor>& tensors) {
  std::set<std::string> out;
  for (const auto& item : tensors) out.insert(item.key());
  return out;
}

// Runs `ours` and `theirs` (a torch::nn::BatchNorm{1,2,3}d with the same options) through three
// training steps and an evaluation, requiring equal outputs, input gradients, parameter gradients
// and running statistics.
template <typename Reference>
void check_equal(fulgur::nn::BatchNorm ours, Reference theirs, const std::vector<int64_t>& shape) {
  CHECK(names(ours->named_parameters()) == names(theirs->named_parameters()));
  CHECK(names(ours->named_buffers()) == names(theirs->named_buffers()));
  torch::manual_seed(11);
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const at::Tensor input = torch::randn(shape) * 3 + 1;
    const at::Tensor x1 = input.clone().requires_grad_(true), x2 = input.clone().requires_grad_(true);
    const at::Tensor y1 = ours->forward(x1), y2 = theirs->forward(x2);
    CHECK(torch::allclose(y1, y2, 1e-5, 1e-6));
    const at::Tensor upstream = torch::randn(shape);
    (y1 * upstream).sum().backward();
    (y2 * upstream).sum().backward();
    CHECK(torch::allclose(x1.grad(), x2.grad(), 1e-5, 1e-6));
    if (ours->weight.defined()) {
      CHECK(torch::allclose(ours->weight.grad(), theirs->weight.grad(), 1e-4, 1e-5));
      CHECK(torch::allclose(ours->bias.grad(), theirs->bias.grad(), 1e-4, 1e-5));
    }
    if (ours->running_mean.defined()) {
      CHECK(torch::allclose(ours->running_mean, theirs->running_mean, 1e-5, 1e-6));
      CHECK(torch::allclose(ours->running_var, theirs->running_var, 1e-5, 1e-6));
      CHECK(ours->num_batches_tracked.template item<int64_t>() == theirs->num_batches_tracked.template item<int64_t>());
    }
  }
  ours->eval();
  theirs->eval();
  const at::Tensor input = torch::randn(shape);
  CHECK(torch::allclose(ours->forward(input), theirs->forward(input), 1e-5, 1e-6));
}

}  // namespace

TEST_CASE("SDK 1.2 fulgur::nn::BatchNorm in one process is torch::nn::BatchNorm1d/2d/3d: values, gradients, names") {
  SUBCASE("1d on (N, C), default options") { check_equal(fulgur::nn::BatchNorm(6), torch::nn::BatchNorm1d(6), {8, 6}); }
  SUBCASE("1d on (N, C, L), cumulative average (momentum none)") {
    check_equal(fulgur::nn::BatchNorm(fulgur::nn::BatchNormOptions(4).momentum(std::nullopt)),
                torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(4).momentum(std::nullopt)), {5, 4, 7});
  }
  SUBCASE("2d, eps and momentum set, no affine") {
    check_equal(fulgur::nn::BatchNorm(fulgur::nn::BatchNormOptions(3).eps(1e-3).momentum(0.3).affine(false)),
                torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(3).eps(1e-3).momentum(0.3).affine(false)),
                {4, 3, 5, 5});
  }
  SUBCASE("3d without running statistics (batch statistics in evaluation too)") {
    check_equal(fulgur::nn::BatchNorm(fulgur::nn::BatchNormOptions(2).track_running_stats(false)),
                torch::nn::BatchNorm3d(torch::nn::BatchNormOptions(2).track_running_stats(false)), {3, 2, 3, 4, 2});
  }
}

TEST_CASE("SDK 1.2 fulgur::nn::BatchNorm: a wrong input is refused naming the layer and the shape") {
  fulgur::nn::BatchNorm layer(4);
  try {
    layer->forward(torch::zeros({2, 3}));
    FAIL("accepted an input with 3 channels");
  } catch (const fulgur::Error& e) {
    CHECK(std::string(e.what()).find("fulgur::nn::BatchNorm(4): expected an input of 2 to 5 dimensions with 4 "
                                     "channels in dimension 1, got shape [2, 3]") != std::string::npos);
  }
  // A local layer is not synchronized; a communicator that is gone is refused, not ignored.
  CHECK_FALSE(layer->synchronized());
  CHECK_THROWS_AS(fulgur::nn::BatchNorm(0), fulgur::Error);
}
