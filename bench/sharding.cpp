// bench_sharding: what ZeRO sharding saves per rank. One real Fulgur run per layout (ddp, or fsdp
// with zero_stage 1, 2 or 3, under Fulgur's launcher) on a transformer-sized MLP stack trained with
// AdamW; after the last step every rank counts the bytes it holds:
//   parameters  the module's parameters (full on every rank in stages 1 and 2; in stage 3 the
//               blocks' parameters hold no storage after the step, the head stays whole)
//   gradients   every gradient tensor alive: the module's and the optimizer's (shards)
//   optimizer   every tensor in the optimizer's state (Adam's moments, step counters)
// and its peak RSS (getrusage) and median step time. bench/sharding.sh runs the layouts side by
// side and prints the table against DeepSpeed's formulas.
//   --strategy ddp|fsdp:1|fsdp:2|fsdp:3 --procs N --width W --layers L --steps S --batch B
#include <fulgur/blocks.h>
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <fmt/format.h>
#include <malloc.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

// L blocks of a transformer's MLP (W -> 4W -> W, with a residual): 8W^2 + 5W parameters each. Each
// runs through fulgur::run_block: a unit of zero_stage = 3, a plain call otherwise.
struct MlpBlockImpl : torch::nn::Module {
  explicit MlpBlockImpl(int64_t width)
      : up(register_module("up", torch::nn::Linear(width, 4 * width))),
        down(register_module("down", torch::nn::Linear(4 * width, width))) {}
  at::Tensor forward(const at::Tensor& h) { return down->forward(torch::gelu(up->forward(h))); }
  torch::nn::Linear up, down;
};
TORCH_MODULE(MlpBlock);

// The blocks are made in configure_model, each marked complete with fulgur::built_block: under
// zero_stage = 3 a rank shards each as it is built and never holds the whole model (the "before
// step 1" column); the other layouts build whole layers, as in the constructor.
struct MlpStack : fulgur::Module {
  MlpStack(int64_t width, int64_t layers) : width(width), layers(layers) {}
  void configure_model() override {
    if (!blocks.empty()) return;
    for (int64_t i = 0; i < layers; ++i)
      blocks.push_back(register_module(fmt::format("block{}", i), fulgur::built_block(MlpBlock(width))));
    head = register_module("head", torch::nn::Linear(width, 10));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor h = b.input;
    for (auto& block : blocks) h = h + fulgur::run_block(block, h);
    return {torch::nn::functional::cross_entropy(head->forward(h), b.target)};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(
        std::make_shared<torch::optim::AdamW>(parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01)))};
  }
  int64_t width, layers;
  std::vector<MlpBlock> blocks;
  torch::nn::Linear head{nullptr};
};

struct RandomData : fulgur::DataModule {
  RandomData(int64_t samples, int64_t width, int64_t batch) : batch(batch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    inputs = at::randn({samples, width}, gen);
    targets = at::randint(0, 10, {samples}, gen, at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(inputs, targets, fulgur::TensorLoaderOptions().batch_size(batch));
  }
  int64_t batch;
  at::Tensor inputs, targets;
};

// Counts, once training is over, what this rank holds; times each step.
struct StateCounter : fulgur::Callback {
  fulgur::HookSet hooks() const override {
    return fulgur::Hook::train_start | fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end |
           fulgur::Hook::train_end;
  }
  void on_train_start(fulgur::TrainerContext&) override { peak_before_training = status_bytes("VmHWM:"); }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override { t0 = Clock::now(); }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t i) override {
    if (i >= 1) step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  // A line of /proc/self/status in bytes (VmHWM: peak resident set so far; VmRSS: now).
  static int64_t status_bytes(const std::string& key) {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line))
      if (line.starts_with(key)) return std::stoll(line.substr(key.size())) * 1024;
    return 0;
  }
  void on_train_end(fulgur::TrainerContext& trainer) override {
    rss_at_end = status_bytes("VmRSS:");
    const struct mallinfo2 heap = mallinfo2();
    malloc_in_use = static_cast<int64_t>(heap.uordblks + heap.hblkhd);
    std::set<const void*> seen;  // memory counted once, whoever holds it (views share their storage)
    auto count = [&](const at::Tensor& t, int64_t& into) {
      if (t.defined() && t.has_storage() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
        into += static_cast<int64_t>(t.storage().nbytes());
    };
    for (const auto& p : trainer.model().parameters()) {
      count(p, parameters);
      count(p.grad(), gradients);
      numel += p.numel();
    }
    for (torch::optim::Optimizer* optimizer : trainer.optimizers()) {
      for (auto& group : optimizer->param_groups())
        for (auto& p : group.params()) count(p.grad(), gradients);
      for (auto& [key, state] : optimizer->state()) {
        (void)key;
        if (auto* adam = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
          count(adam->exp_avg(), optimizer_bytes);
          count(adam->exp_avg_sq(), optimizer_bytes);
          count(adam->max_exp_avg_sq(), optimizer_bytes);
        }
      }
      // The tensors the optimizer steps: in stages 1 and 2 views of the parameters (counted
      // already), in stage 3 tensors of their own.
      for (auto& group : optimizer->param_groups())
        for (auto& p : group.params()) count(p, shard_parameters);
    }
  }
  Clock::time_point t0;
  std::vector<double> step_ms;
  int64_t parameters = 0, shard_parameters = 0, gradients = 0, optimizer_bytes = 0, numel = 0;
  int64_t peak_before_training = 0, rss_at_end = 0;
  int64_t malloc_in_use = 0;  // bytes malloc has handed out and not taken back, at the end
};

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string strategy = arg(argc, argv, "--strategy", "ddp");
  const int64_t procs = std::stoll(arg(argc, argv, "--procs", "2"));
  const int64_t width = std::stoll(arg(argc, argv, "--width", "768"));
  const int64_t layers = std::stoll(arg(argc, argv, "--layers", "10"));
  const int64_t steps = std::stoll(arg(argc, argv, "--steps", "4"));
  const int64_t batch = std::stoll(arg(argc, argv, "--batch", "8"));
  std::string strategy_table = "[strategy]\ntimeout = 600.0\n";
  std::string name = strategy;
  if (strategy.starts_with("fsdp:")) {
    strategy_table += "zero_stage = " + strategy.substr(5) + "\n";
    name = "fsdp";
  }
  const std::string toml = fmt::format(R"(
[trainer]
accelerator = "cpu"
strategy = "{}"
devices = "{}"
max_epochs = 1
limit_train_batches = {}
seed = 1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
[accelerator]
threads = 1
{})",
                                       name, procs, steps, strategy_table);
  fulgur::Trainer trainer(fulgur::parse_config(toml, "bench_sharding.toml"));
  MlpStack model(width, layers);
  RandomData data(batch * steps * procs, width, batch);
  auto counter = std::make_shared<StateCounter>();
  trainer.add_callback(counter);
  trainer.fit(model, data);
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  std::vector<double> ms = counter->step_ms;
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  std::cout << fmt::format(
      "RESULT strategy={} procs={} rank={} numel={} parameters={} shard_parameters={} gradients={} optimizer={} "
      "peak_rss={} peak_rss_before_training={} rss_at_end={} malloc_in_use={} step_ms={:.1f}\n",
      strategy, procs, std::getenv("RANK") ? std::getenv("RANK") : "0", counter->numel, counter->parameters,
      counter->shard_parameters, counter->gradients, counter->optimizer_bytes, usage.ru_maxrss * 1024L,
      counter->peak_before_training, counter->rss_at_end, counter->malloc_in_use, ms.empty() ? 0.0 : ms[ms.size() / 2]);
  return 0;
}
