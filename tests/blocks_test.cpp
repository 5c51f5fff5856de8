// fulgur::run_block in one process: a plain call without a strategy, and activation checkpointing
// (gradients equal to the plain run's, dropout included; the memory autograd holds between forward
// and backward, measured).
#include <fulgur/blocks.h>

#include <doctest/doctest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <vector>

namespace {

// A transformer-MLP-like block: its internal activations (4 per row of the input, 3 of them wide)
// are what checkpointing saves; only the block's input is kept.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t width, double dropout)
      : up(register_module("up", torch::nn::Linear(width, 2 * width))),
        down(register_module("down", torch::nn::Linear(2 * width, width))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::gelu(down(drop(torch::gelu(up(x))))); }
  torch::nn::Linear up, down;
  torch::nn::Dropout drop;
};
TORCH_MODULE(MlpBlock);

struct Stack : torch::nn::Module {
  Stack(int64_t depth, int64_t width, double dropout) {
    for (int64_t i = 0; i < depth; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), MlpBlock(width, dropout)));
  }
  at::Tensor forward(at::Tensor x, bool checkpoint) {
    for (auto& block : blocks)
      x = fulgur::run_block(block, x, fulgur::BlockOptions().checkpoint_activations(checkpoint));
    return x;
  }
  std::vector<MlpBlock> blocks;
};

// Bytes the C allocator has handed out and not taken back (heap and mmapped chunks): what the
// tensors alive at this moment hold, independent of what the OS keeps resident.
size_t bytes_in_use() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

struct Pass {
  std::vector<at::Tensor> gradients;
  at::Tensor input_gradient;
  size_t held_for_backward = 0;  // bytes allocated by the forward and still held when backward starts
};

Pass train_once(bool checkpoint, double dropout) {
  torch::manual_seed(3);
  Stack model(8, 256, dropout);
  model.train();
  at::Tensor input = torch::randn({512, 256}).requires_grad_(true);
  const size_t before = bytes_in_use();
  at::Tensor loss = model.forward(input, checkpoint).square().mean();
  Pass pass;
  pass.held_for_backward = bytes_in_use() - before;
  loss.backward();
  for (const auto& p : model.parameters()) pass.gradients.push_back(p.grad().clone());
  pass.input_gradient = input.grad().clone();
  return pass;
}

double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST_CASE("run_block: without a sharded strategy or options it is the forward itself") {
  torch::manual_seed(1);
  torch::nn::Linear layer(4, 3);
  const at::Tensor x = torch::randn({2, 4});
  CHECK(fulgur::installed_block_hooks() == nullptr);
  CHECK(torch::equal(fulgur::run_block(layer, x), layer(x)));
  int calls = 0;
  const at::Tensor y = fulgur::run_block(*layer, x, [&](const at::Tensor& in) {
    ++calls;
    return in * 2;
  });
  CHECK(calls == 1);
  CHECK(torch::equal(y, x * 2));
  // Without gradients (validation, prediction) checkpointing has nothing to save: one plain call.
  torch::NoGradGuard no_grad;
  calls = 0;
  fulgur::run_block(
      *layer, x,
      [&](const at::Tensor& in) {
        ++calls;
        return in;
      },
      fulgur::BlockOptions().checkpoint_activations(true));
  CHECK(calls == 1);
}

TEST_CASE("activation checkpointing: the gradients of the plain run, with dropout, and far less memory held") {
  const Pass plain = train_once(false, 0.1);
  const Pass recomputed = train_once(true, 0.1);
  // The recomputation draws the same dropout masks (the random state of the first run is
  // restored), so the gradients agree to rounding.
  CHECK(max_difference(recomputed.gradients, plain.gradients) < 1e-6);
  CHECK((recomputed.input_gradient - plain.input_gradient).abs().max().item<double>() < 1e-6);
  // Plain: each block keeps its input, two 512-wide and two 256-wide activations and a dropout
  // mask (~2.3 MiB per block of 512 rows); checkpointed: the inputs only (0.5 MiB per block).
  MESSAGE("held between forward and backward: plain " << plain.held_for_backward << " bytes, checkpointed "
                                                      << recomputed.held_for_backward << " bytes");
  CHECK(recomputed.held_for_backward * 3 < plain.held_for_backward);
}

TEST_CASE("activation checkpointing: backward leaves the caller's random stream where the plain run leaves it") {
  torch::manual_seed(11);
  Stack model(2, 8, 0.5);
  model.train();
  auto draw_after_step = [&](bool checkpoint) {
    torch::manual_seed(12);
    at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
    model.forward(x, checkpoint).sum().backward();
    return torch::rand({4});
  };
  const at::Tensor after_plain = draw_after_step(false);
  CHECK(torch::equal(draw_after_step(true), after_plain));
}
