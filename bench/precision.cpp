// Step time and peak memory of each precision plugin relative to 32-true, side by side in one
// run: the example CNN (batch 64) and a matmul-heavy MLP 784-2048-2048-10 (batch 256), synthetic
// Fashion-MNIST-shaped data. Each measurement is its own child process (peak RSS is per process);
// children of all precisions are interleaved, and the median over repetitions is reported.
//
//   bench_precision [--reps N] [--steps N]
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>

#include <fmt/format.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "fashion_mnist.h"

namespace {

using Clock = std::chrono::steady_clock;

// Matmul-heavy: most time in three GEMMs, where bf16 kernels matter most.
struct WideMlp : fulgur::Module {
  WideMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 2048));
    fc2 = register_module("fc2", torch::nn::Linear(2048, 2048));
    fc3 = register_module("fc3", torch::nn::Linear(2048, 10));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor h = torch::relu(fc1->forward(b.input.flatten(1)));
    h = torch::relu(fc2->forward(h));
    return {torch::nn::functional::cross_entropy(fc3->forward(h).to(at::kFloat), b.target)};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), 1e-3))};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// Wall time of each training batch, hook to hook.
struct StepTimer : fulgur::Callback {
  fulgur::HookSet hooks() const override { return fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end; }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override { start = Clock::now(); }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput& out, const fulgur::Batch&,
                          int64_t) override {
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    last_loss = out.loss.defined() ? out.loss.item<double>() : 0.0;
  }
  Clock::time_point start;
  std::vector<double> ms;
  double last_loss = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

struct DataOnly : fulgur::DataModule {
  DataOnly(int64_t n, int64_t batch) : batch(batch) {
    x = at::randn({n, 1, 28, 28});
    y = at::randint(0, 10, {n}, at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch));
  }
  int64_t batch;
  at::Tensor x, y;
};

// One measurement in this process: prints "RESULT median_ms peak_rss_mb final_loss".
int child(const std::string& model_name, const std::string& precision, int64_t steps) {
  const int64_t batch = model_name == "cnn" ? 64 : 256;
  auto config = fulgur::parse_config(fmt::format(R"(
[trainer]
precision = "{}"
max_steps = {}
seed = 1
limit_val_batches = 0
enable_checkpointing = false
enable_progress_bar = false
enable_model_summary = false
logger = false
default_root_dir = "/tmp"
)",
                                                 precision, steps),
                                     "bench_precision.toml");
  fulgur::Trainer trainer(std::move(config));
  auto timer = std::make_shared<StepTimer>();
  trainer.add_callback(timer);
  DataOnly data(batch * steps, batch);
  std::shared_ptr<fulgur::Module> module;
  if (model_name == "cnn") {
    fulgur::Options hp("[model]");
    hp.set("arch", std::string("cnn"));
    module = fulgur::examples::make_fashion_mnist_model(hp);
  } else {
    module = std::make_shared<WideMlp>();
  }
  trainer.fit(*module, data);
  std::vector<double> ms(timer->ms.begin() + std::min<size_t>(5, timer->ms.size()), timer->ms.end());
  std::printf("RESULT %.4f %.1f %.6f\n", median(ms), peak_rss_mb(), timer->last_loss);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int reps = 3;
    int64_t steps = 40;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--child" && i + 3 < argc) return child(argv[i + 1], argv[i + 2], std::stoll(argv[i + 3]));
      if (a == "--reps" && i + 1 < argc)
        reps = std::stoi(argv[++i]);
      else if (a == "--steps" && i + 1 < argc)
        steps = std::stoll(argv[++i]);
      else {
        std::fprintf(stderr, "usage: bench_precision [--reps N] [--steps N]\n");
        return 2;
      }
    }
    const std::vector<std::string> models = {"cnn", "wide_mlp"};
    const std::vector<std::string> precisions = {"32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true"};
    struct Result {
      std::vector<double> ms, rss, loss;
    };
    std::map<std::pair<std::string, std::string>, Result> results;
    for (int r = 0; r < reps; ++r)
      for (const auto& m : models)
        for (const auto& p : precisions) {
          const std::string cmd = fmt::format("'{}' --child {} {} {} 2>/dev/null", argv[0], m, p, steps);
          FILE* pipe = ::popen(cmd.c_str(), "r");
          double ms = 0, rss = 0, loss = 0;
          bool ok = false;
          char line[1024];
          // Plugins may log to stdout (warnings); the measurement is the RESULT line.
          while (pipe && std::fgets(line, sizeof(line), pipe))
            if (std::sscanf(line, "RESULT %lf %lf %lf", &ms, &rss, &loss) == 3) ok = true;
          const int status = pipe ? ::pclose(pipe) : -1;
          if (!ok || status != 0) {
            std::fprintf(stderr, "bench_precision: %s %s failed (status %d)\n", m.c_str(), p.c_str(), status);
            return 1;
          }
          auto& res = results[{m, p}];
          res.ms.push_back(ms);
          res.rss.push_back(rss);
          res.loss.push_back(loss);
        }
    std::printf("## Precision plugins vs 32-true (CPU: %d intra-op threads, %lld steps, median of %d processes)\n\n",
                at::get_num_threads(), static_cast<long long>(steps), reps);
    std::printf(
        "| model | precision | ms/step | step time vs 32-true | peak RSS MB | peak RSS vs 32-true | final loss |\n");
    std::printf("|---|---|---:|---:|---:|---:|---:|\n");
    for (const auto& m : models) {
      const double base_ms = median(results[{m, "32-true"}].ms), base_rss = median(results[{m, "32-true"}].rss);
      for (const auto& p : precisions) {
        const auto& res = results[{m, p}];
        std::printf("| %s | %s | %.2f | %.3f | %.0f | %.3f | %.4f |\n", m.c_str(), p.c_str(), median(res.ms),
                    median(res.ms) / base_ms, median(res.rss), median(res.rss) / base_rss, median(res.loss));
      }
    }
    return 0;
  } catch (const fulgur::Error& e) {
    std::fprintf(stderr, "bench_precision: %s\n", e.what());
    return 1;
  }
}
