// bench_observability: the step-time cost of each observability plugin, measured side by side in
// one process against the same Trainer without it (same model, data, optimizer and seed; runs
// interleaved in rotating order so that drifts in machine load hit every variant alike).
//
//   bench_observability [--runs N] [--steps N] [--batch N] [--arch mlp|cnn] [--threads N]
//
// Reported per variant: the mean step time (it includes the periodic work: logging every
// log_every_n_steps, a profiler's recorded cycle), the median step time, process CPU time per
// step, and the ratios to the baseline without observability plugins ("none") and to the variant
// it adds to (the monitors need a logger: they add to "tensorboard").
#include "fashion_mnist.h"

#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/error.h>
#include <fulgur/trainer.h>

#include <fmt/format.h>
#include <ftw.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace ex = fulgur::examples;
using Clock = std::chrono::steady_clock;

constexpr int64_t kSeed = 42;

double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Variant {
  std::string name;
  std::string base;  // the variant this one adds a plugin to
  std::string toml;  // appended to the common [trainer] table
};

// Default settings throughout: what a user gets by naming the plugin.
std::vector<Variant> variants() {
  const std::string tb = "[[loggers]]\nname = \"tensorboard\"\n";
  return {
      {"none", "", "logger = false\n"},
      // A/A control: the baseline again. Its ratio to "none" is the noise floor of this run.
      {"none (again)", "none", "logger = false\n"},
      {"csv", "none", "[[loggers]]\nname = \"csv\"\n"},
      {"tensorboard", "none", tb},
      {"tensorboard + lr_monitor", "tensorboard", tb + "[[callbacks]]\nname = \"lr_monitor\"\n"},
      {"tensorboard + throughput_monitor", "tensorboard", tb + "[[callbacks]]\nname = \"throughput_monitor\"\n"},
      {"tensorboard + device_stats", "tensorboard", tb + "[[callbacks]]\nname = \"device_stats\"\n"},
      {"timer", "none", "logger = false\n[[callbacks]]\nname = \"timer\"\nduration = \"01:00:00:00\"\n"},
      {"pytorch profiler", "none", "logger = false\n[profiler]\nname = \"pytorch\"\n"},
      {"simple profiler", "none", "logger = false\n[profiler]\nname = \"simple\"\nfilename = \"simple\"\n"},
  };
}

struct Options {
  int64_t runs = 5, steps = 300, warmup = 10, batch = 64, threads = 0;
  std::string arch = "mlp";
};

class BenchData : public fulgur::DataModule {
 public:
  BenchData(at::Tensor x, at::Tensor y, int64_t batch) : x_(std::move(x)), y_(std::move(y)), batch_(batch) {}
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(x_, y_, fulgur::TensorLoaderOptions().batch_size(batch_).shuffle(false));
  }

 private:
  at::Tensor x_, y_;
  int64_t batch_;
};

// Timestamps each batch start into a preallocated vector; no allocation or sync while timing.
class StepProbe : public fulgur::Callback {
 public:
  StepProbe(int64_t steps, int64_t warmup) : starts(steps), warmup(warmup) {}
  fulgur::HookSet hooks() const override { return fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end; }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t i) override {
    if (i == warmup) cpu_start = process_cpu_ms();
    if (i < static_cast<int64_t>(starts.size())) starts[i] = Clock::now();
  }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t i) override {
    if (i + 1 == static_cast<int64_t>(starts.size())) {
      end = Clock::now();
      cpu_end = process_cpu_ms();
    }
  }
  std::vector<Clock::time_point> starts;
  int64_t warmup;
  Clock::time_point end;
  double cpu_start = 0, cpu_end = 0;
};

struct Run {
  double mean_ms = 0, median_ms = 0, cpu_ms = 0;
};

Run run_once(const Options& opt, const Variant& v, const at::Tensor& x, const at::Tensor& y, const fs::path& root) {
  const std::string toml = fmt::format(R"(
[trainer]
max_epochs = 1
seed = {}
default_root_dir = "{}"
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
{}
[model]
arch = "{}"
optimizer = "adam"
lr = 0.001
)",
                                       kSeed, root.string(), v.toml, opt.arch);
  fulgur::Trainer trainer(fulgur::parse_config(toml, root / "bench.toml"));
  fulgur::Options hp("[model]");
  hp.set("arch", opt.arch).set("optimizer", std::string("adam")).set("lr", 1e-3);
  auto model = ex::make_fashion_mnist_model(hp);
  BenchData data(x, y, opt.batch);
  auto probe = std::make_shared<StepProbe>(opt.steps, opt.warmup);
  trainer.add_callback(probe);
  trainer.fit(*model, data);
  Run r;
  std::vector<double> steps;
  for (int64_t i = opt.warmup; i < opt.steps; ++i) {
    const Clock::time_point next = i + 1 < opt.steps ? probe->starts[i + 1] : probe->end;
    steps.push_back(std::chrono::duration<double, std::milli>(next - probe->starts[i]).count());
  }
  const double n = static_cast<double>(opt.steps - opt.warmup);
  r.median_ms = median(steps);
  r.mean_ms = std::chrono::duration<double, std::milli>(probe->end - probe->starts[opt.warmup]).count() / n;
  r.cpu_ms = (probe->cpu_end - probe->cpu_start) / n;
  return r;
}

void remove_tree(const fs::path& root) {
  ::nftw(
      root.c_str(), [](const char* file, const struct stat*, int, FTW*) { return std::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

int64_t parse_int(const char* text, const char* flag) {
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    throw fulgur::Error(fulgur::ErrorKind::invalid_argument,
                        fmt::format("{} expects an integer, got '{}'", flag, text));
  }
}

}  // namespace

int main(int argc, char** argv) try {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) throw fulgur::Error(fulgur::ErrorKind::invalid_argument, a + " needs a value");
      return argv[++i];
    };
    if (a == "--runs")
      opt.runs = parse_int(value(), "--runs");
    else if (a == "--steps")
      opt.steps = parse_int(value(), "--steps");
    else if (a == "--batch")
      opt.batch = parse_int(value(), "--batch");
    else if (a == "--threads")
      opt.threads = parse_int(value(), "--threads");
    else if (a == "--arch")
      opt.arch = value();
    else {
      std::fprintf(stderr,
                   "usage: bench_observability [--runs N] [--steps N] [--batch N] [--arch mlp|cnn] [--threads N]\n");
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  if (opt.runs < 1 || opt.steps <= opt.warmup + 1 || opt.batch < 1)
    throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--runs >= 1, --steps > 11 and --batch >= 1 please");
  if (opt.threads > 0) at::set_num_threads(static_cast<int>(opt.threads));

  auto gen = at::detail::createCPUGenerator(kSeed);
  const at::Tensor x = torch::randn({opt.steps * opt.batch, 1, 28, 28}, gen);
  const at::Tensor y = torch::randint(0, ex::kFashionMnistClasses, {opt.steps * opt.batch}, gen, torch::kInt64);

  std::string pattern = (fs::temp_directory_path() / "fulgur-bench-obs-XXXXXX").string();
  if (!::mkdtemp(pattern.data())) throw fulgur::Error(fulgur::ErrorKind::io, "cannot create a temporary directory");
  const fs::path root = pattern;

  const std::vector<Variant> vs = variants();
  std::vector<std::vector<Run>> runs(vs.size());
  for (int64_t r = 0; r < opt.runs; ++r) {
    std::fprintf(stderr, "bench_observability: run %ld of %ld\n", r + 1, opt.runs);
    for (size_t k = 0; k < vs.size(); ++k) {
      const size_t i = (k + static_cast<size_t>(r)) % vs.size();  // rotate who goes first
      runs[i].push_back(run_once(opt, vs[i], x, y, root / fmt::format("{}-{}", i, r)));
    }
  }
  remove_tree(root);

  auto med = [](const std::vector<Run>& v, double Run::*field) {
    std::vector<double> values;
    for (const Run& r : v) values.push_back(r.*field);
    return median(values);
  };
  auto index_of = [&](const std::string& name) {
    for (size_t i = 0; i < vs.size(); ++i)
      if (vs[i].name == name) return i;
    return size_t{0};
  };
  std::printf("\n## Observability plugins: step time relative to the Trainer without them\n\n");
  std::printf(
      "torch %s, %d intra-op thread(s), %s batch %ld, Adam, %ld steps per run (first %ld left out), median over %ld "
      "interleaved runs, log_every_n_steps = 50, every plugin at its defaults. Mean step time counts the periodic "
      "work (logging, the profiler's recorded steps); ratios use it.\n\n",
      TORCH_VERSION, at::get_num_threads(), opt.arch.c_str(), opt.batch, opt.steps, opt.warmup, opt.runs);
  std::printf(
      "| variant | mean ms/step | median ms/step | CPU ms/step | vs none (mean) | vs none (median) | vs none "
      "(CPU) | vs base (mean) | vs base (median) | per-run vs base (median) | base |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  const size_t none = index_of("none");
  const double none_mean = med(runs[none], &Run::mean_ms), none_cpu = med(runs[none], &Run::cpu_ms);
  const double none_median = med(runs[none], &Run::median_ms);
  for (size_t i = 0; i < vs.size(); ++i) {
    const double mean = med(runs[i], &Run::mean_ms), median_ms = med(runs[i], &Run::median_ms);
    const double cpu = med(runs[i], &Run::cpu_ms);
    std::string vs_base_mean = "-", vs_base_median = "-", spread = "-";
    if (!vs[i].base.empty()) {
      const auto& base = runs[index_of(vs[i].base)];
      vs_base_mean = fmt::format("{:.3f}", mean / med(base, &Run::mean_ms));
      vs_base_median = fmt::format("{:.3f}", median_ms / med(base, &Run::median_ms));
      // Each run's pair ran close together: the spread of their ratios shows what noise does.
      double lo = INFINITY, hi = 0;
      for (size_t r = 0; r < runs[i].size(); ++r) {
        lo = std::min(lo, runs[i][r].median_ms / base[r].median_ms);
        hi = std::max(hi, runs[i][r].median_ms / base[r].median_ms);
      }
      spread = fmt::format("{:.3f}-{:.3f}", lo, hi);
    }
    std::printf("| %s | %.4f | %.4f | %.4f | %.3f | %.3f | %.3f | %s | %s | %s | %s |\n", vs[i].name.c_str(), mean,
                median_ms, cpu, mean / none_mean, median_ms / none_median, cpu / none_cpu, vs_base_mean.c_str(),
                vs_base_median.c_str(), spread.c_str(), vs[i].base.empty() ? "-" : vs[i].base.c_str());
  }
  std::printf(
      "\nTarget: tensorboard and the monitors at default settings <= 1.01 of their base. Read every ratio against "
      "\"none (again)\": a ratio inside its distance from 1.000 is below what this run can resolve.\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_observability: %s\n", e.what());
  return 1;
}
