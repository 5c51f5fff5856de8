// bench_ddp: what data parallelism buys on this machine. One measurement per process layout, each
// a real Fulgur run (strategy ddp under Fulgur's launcher, or single_device):
//   --procs P --threads T --batch B [--accumulate K]  ->  a line "RESULT key=value ..." from rank 0
// bench/ddp.sh runs the layouts side by side and prints the table. Timings are per training batch
// (on_train_batch_start to on_train_batch_end: forward, backward with its all-reduce, step).
// With several processes it also times the per-batch signal agreement (interrupt_due in
// core/src/signal_connector.h: one boolean all-reduce through the strategy after every batch),
// as back-to-back TrainerContext::agree calls: the same strategy, process group and path.
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/module.h>
#include <fulgur/strategy.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include "fashion_mnist.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

// Compute-bound on a CPU: matmuls dominate, 1.9 M parameters (7.6 MB of gradients per step).
struct WideMlp : fulgur::Module {
  WideMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 1024));
    fc2 = register_module("fc2", torch::nn::Linear(1024, 1024));
    fc3 = register_module("fc3", torch::nn::Linear(1024, 10));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor h = torch::relu(fc2->forward(torch::relu(fc1->forward(b.input))));
    return {torch::nn::functional::cross_entropy(fc3->forward(h), b.target)};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.01)))};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// Compute-bound with few parameters: three 3x3 convolutions at 28x28, global average pooling
// (56 k parameters, 0.2 MB of gradients per step against ~0.1 GFLOP per sample).
struct ConvNet : fulgur::Module {
  ConvNet() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    c3 = register_module("c3", torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 64, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(64, 10));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor h = torch::relu(c1->forward(b.input.view({-1, 1, 28, 28})));
    h = torch::relu(c3->forward(torch::relu(c2->forward(h))));
    return {torch::nn::functional::cross_entropy(fc->forward(h.mean({2, 3})), b.target)};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.01)))};
  }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr}, c3{nullptr};
  torch::nn::Linear fc{nullptr};
};

struct RandomData : fulgur::DataModule {
  // `images`: N x 1 x 28 x 28 (what the Fashion-MNIST example's nets take), else N x 784.
  RandomData(int64_t samples, int64_t batch, bool images) : batch(batch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    inputs = images ? at::randn({samples, 1, 28, 28}, gen) : at::randn({samples, 784}, gen);
    targets = at::randint(0, 10, {samples}, gen, at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(inputs, targets, fulgur::TensorLoaderOptions().batch_size(batch));
  }
  int64_t batch;
  at::Tensor inputs, targets;
};

struct BatchTimer : fulgur::Callback {
  fulgur::HookSet hooks() const override {
    return fulgur::Hook::fit_start | fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end;
  }
  void on_fit_start(fulgur::TrainerContext& trainer) override {
    // The all-reduce alone, on a tensor the size of all gradients, for the overlap estimate.
    int64_t numel = 0;
    for (const auto& p : trainer.model().parameters()) numel += p.numel();
    at::Tensor flat = torch::ones({numel});
    for (int i = 0; i < 23; ++i) {
      trainer.barrier("bench");
      const auto t0 = Clock::now();
      trainer.reduce(flat, fulgur::ReduceOp::mean);
      if (i >= 3) allreduce_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    if (trainer.cluster().world_size <= 1) return;  // interrupt_due does not communicate then
    // The signal agreement: `agree_repeats` means of `agree_calls` calls, after one warm-up repeat.
    for (int r = 0; r <= agree_repeats; ++r) {
      trainer.barrier("bench");
      const auto t0 = Clock::now();
      for (int i = 0; i < agree_calls; ++i) (void)trainer.agree(false, /*all=*/false);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / agree_calls;
      if (r > 0) agree_us.push_back(us);
    }
  }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override { t0 = Clock::now(); }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t batch_idx) override {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (batch_idx >= 3) batch_ms.push_back(ms);  // warm-up: allocator, bucket rebuild after step 1
  }
  static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  }
  int agree_repeats = 20, agree_calls = 200;
  Clock::time_point t0;
  std::vector<double> batch_ms, allreduce_ms, agree_us;
};

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t procs = std::stoll(arg(argc, argv, "--procs", "2"));
  const int64_t threads = std::stoll(arg(argc, argv, "--threads", "1"));
  const int64_t batch = std::stoll(arg(argc, argv, "--batch", "128"));
  const int64_t steps = std::stoll(arg(argc, argv, "--steps", "40"));
  // A large accumulation makes every measured batch a micro-step without communication.
  const int64_t accumulate = std::stoll(arg(argc, argv, "--accumulate", "1"));
  const std::string model_name = arg(argc, argv, "--model", "mlp");
  const int64_t bucket_mb = std::stoll(arg(argc, argv, "--bucket-mb", "25"));
  const std::string toml = fmt::format(R"(
[trainer]
accelerator = "cpu"
strategy = "{}"
devices = "{}"
max_epochs = 1
limit_train_batches = {}
accumulate_grad_batches = {}
seed = 1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
[accelerator]
threads = {}
{})",
                                       procs > 1 ? "ddp" : "single_device", procs, steps, accumulate, threads,
                                       procs > 1 ? fmt::format("[strategy]\nbucket_cap_mb = {}\n", bucket_mb) : "");
  fulgur::Trainer trainer(fulgur::parse_config(toml, "bench_ddp.toml"));
  // fashion_cnn / fashion_mlp: the Fashion-MNIST example's nets (its TOML trains the CNN, batch 64).
  const bool fashion = model_name.starts_with("fashion_");
  std::shared_ptr<fulgur::Module> model;
  if (fashion) {
    fulgur::Options hp("[model]");
    hp.set("arch", model_name.substr(8)).set("optimizer", std::string("adam")).set("lr", 1e-3);
    model = fulgur::examples::make_fashion_mnist_model(hp);
  } else if (model_name == "conv") {
    model = std::make_shared<ConvNet>();
  } else if (model_name == "mlp") {
    model = std::make_shared<WideMlp>();
  } else {
    std::cerr << "bench_ddp: --model " << model_name << ": expected mlp, conv, fashion_cnn or fashion_mlp\n";
    return 2;
  }
  RandomData data(batch * steps, batch, fashion);
  auto timer = std::make_shared<BatchTimer>();
  trainer.add_callback(timer);
  trainer.fit(*model, data);
  const char* rank = std::getenv("RANK");
  if (!rank || std::string(rank) == "0") {
    const auto& agree = timer->agree_us;
    const bool agreed = !agree.empty();
    std::cout << fmt::format(
        "RESULT model={} procs={} threads={} batch={} accumulate={} batch_ms={:.3f} "
        "allreduce_ms={:.3f} agree_us_min={:.2f} agree_us_median={:.2f} agree_us_max={:.2f}\n",
        model_name, procs, threads, batch, accumulate, BatchTimer::median(timer->batch_ms),
        procs > 1 ? BatchTimer::median(timer->allreduce_ms) : 0.0,
        agreed ? *std::min_element(agree.begin(), agree.end()) : 0.0, agreed ? BatchTimer::median(agree) : 0.0,
        agreed ? *std::max_element(agree.begin(), agree.end()) : 0.0);
  }
  return 0;
}
