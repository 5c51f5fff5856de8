// bench_step_time: the cost of the Fulgur Trainer over a hand-written LibTorch loop, measured side
// by side in one process on the same model, data, optimizer (Adam) and seed.
//
//   bench_step_time                 step time: median over interleaved runs, ratio Fulgur/raw
//   bench_step_time --startup       time from process start to the first training step
//
// A ratio is printed only after checking that both sides computed the same thing: the same number
// of steps and the same final loss (both start from identical weights, see the same batches in the
// same order and draw dropout masks from the same seed).
#include "fashion_mnist.h"

#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/error.h>
#include <fulgur/trainer.h>

#include <fcntl.h>
#include <fmt/format.h>
#include <ftw.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace ex = fulgur::examples;
using Clock = std::chrono::steady_clock;

constexpr int64_t kSeed = 42;
constexpr double kLr = 1e-3;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// CPU time of the whole process (every thread), in ms. A syscall, so read twice per run only.
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

struct Case {
  std::string arch;
  int64_t batch;
  int64_t steps;
};

struct BenchOptions {
  int64_t runs = 5;
  int64_t warmup = 5;         // first steps of each run left out of the step time
  double steps_scale = 1.0;   // --quick shrinks every case
  std::string data = "auto";  // auto | fashion | synthetic
  bool startup = false;
  int64_t threads = 0;  // intra-op threads (0: torch's default, one per core)
  std::string probe;    // internal: "raw" / "fulgur" child process of --startup
  int64_t spawn_ns = 0;
  std::string probe_root;         // internal: where the child's Trainer writes (the parent removes it)
  std::vector<std::string> only;  // e.g. "mlp64"
};

struct Data {
  at::Tensor x, y;
  std::string source;
};

// The first `n` Fashion-MNIST training images, or seeded random tensors of the same shape.
Data make_data(const BenchOptions& opt, int64_t n) {
  const bool have_fashion = fs::exists(fs::path(ex::kFashionMnistDefaultDir) / "train-images-idx3-ubyte.gz");
  if (opt.data == "fashion" || (opt.data == "auto" && have_fashion)) {
    ex::FashionMnistSplit s = ex::load_fashion_mnist(ex::kFashionMnistDefaultDir, /*train=*/true);
    if (n > s.images.size(0))
      throw fulgur::Error(fulgur::ErrorKind::invalid_argument,
                          fmt::format("a run needs {} images, Fashion-MNIST has {}", n, s.images.size(0)));
    return {s.images.narrow(0, 0, n).contiguous(), s.labels.narrow(0, 0, n).contiguous(), "Fashion-MNIST train"};
  }
  auto gen = at::detail::createCPUGenerator(kSeed);
  return {torch::randn({n, 1, 28, 28}, gen), torch::randint(0, ex::kFashionMnistClasses, {n}, gen, torch::kInt64),
          "synthetic"};
}

fulgur::Options model_hparams(const std::string& arch) {
  fulgur::Options hp("[model]");
  hp.set("arch", arch).set("optimizer", std::string("adam")).set("lr", kLr);
  return hp;
}

// Serves the benchmark tensors in order (no shuffling: the hand-written loop slices them in order).
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

// Timestamps every training batch start into a preallocated vector (no allocation in the loop) and
// keeps the last step's loss without reading it (no host sync while timing).
class StepProbe : public fulgur::Callback {
 public:
  StepProbe(int64_t steps, int64_t warmup) : starts(steps), warmup(std::min(warmup, steps - 1)) {}
  fulgur::HookSet hooks() const override {
    return fulgur::Hook::train_start | fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end;
  }
  // Both sides reseed right before their first step, so dropout draws the same masks whatever
  // the Trainer did with the generator before (the raw loop does the same).
  void on_train_start(fulgur::TrainerContext&) override { torch::manual_seed(kSeed); }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t i) override {
    if (i == 0 && on_first_step) on_first_step();
    if (i == warmup) cpu_start = process_cpu_ms();
    if (i < static_cast<int64_t>(starts.size())) starts[i] = Clock::now();
  }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput& out, const fulgur::Batch&,
                          int64_t i) override {
    ++count;
    if (i + 1 == static_cast<int64_t>(starts.size())) {
      end = Clock::now();
      cpu_end = process_cpu_ms();
      last_loss = out.loss;
    }
  }
  std::vector<Clock::time_point> starts;
  int64_t warmup;
  double cpu_start = 0, cpu_end = 0;
  Clock::time_point end;
  int64_t count = 0;
  at::Tensor last_loss;
  void (*on_first_step)() = nullptr;
};

struct RunResult {
  double step_ms = 0;  // median step over steps [warmup, steps): robust to preemption by other load
  double mean_ms = 0;  // mean over the same steps: includes periodic work (logging every N steps)
  double cpu_ms = 0;   // process CPU time per step over the same steps: what preemption cannot inflate
  double wall_ms = 0;  // the whole loop (raw) / fit() (Fulgur): setup, epoch end, teardown included
  int64_t steps = 0;
  double final_loss = NAN;
};

// Step i lasts from its start to the next one's (the last to the end of the loop): data fetch,
// hooks, logging, everything the loop does per step.
void step_times(const std::vector<Clock::time_point>& starts, Clock::time_point end, int64_t warmup, RunResult& r) {
  const int64_t n = static_cast<int64_t>(starts.size());
  const int64_t w = std::min(warmup, n - 1);
  r.cpu_ms /= static_cast<double>(n - w);
  std::vector<double> steps;
  for (int64_t i = w; i < n; ++i) steps.push_back(ms_between(starts[i], i + 1 < n ? starts[i + 1] : end));
  r.step_ms = median(steps);
  r.mean_ms = ms_between(starts[w], end) / static_cast<double>(n - w);
}

// Identical initial weights for both sides of every run of a case.
void copy_parameters(torch::nn::Module& to, const std::vector<at::Tensor>& from) {
  torch::NoGradGuard no_grad;
  auto params = to.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(from[i]);
}

RunResult run_raw(const Case& c, const Data& d, const std::vector<at::Tensor>& init, int64_t warmup,
                  void (*on_first_step)() = nullptr) {
  auto model = ex::make_fashion_mnist_model(model_hparams(c.arch));
  copy_parameters(*model, init);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(kLr));
  model->train();

  std::vector<Clock::time_point> starts(c.steps);
  at::Tensor loss;
  const Clock::time_point t0 = Clock::now();
  torch::manual_seed(kSeed);  // as StepProbe::on_train_start does on the Fulgur side
  const int64_t cpu_from = std::min(warmup, c.steps - 1);
  double cpu_start = 0;
  for (int64_t i = 0; i < c.steps; ++i) {
    if (i == 0 && on_first_step) on_first_step();
    if (i == cpu_from) cpu_start = process_cpu_ms();
    starts[i] = Clock::now();
    at::Tensor x = d.x.narrow(0, i * c.batch, c.batch);
    at::Tensor y = d.y.narrow(0, i * c.batch, c.batch);
    loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
  const Clock::time_point end = Clock::now();
  RunResult r;
  r.cpu_ms = process_cpu_ms() - cpu_start;
  step_times(starts, end, warmup, r);
  r.wall_ms = ms_between(t0, end);
  r.steps = c.steps;
  r.final_loss = loss.item<double>();
  return r;
}

// The Trainer as a user would configure it: default plugins plus the CSV logger, one epoch over
// exactly `steps` batches, a checkpoint at epoch end.
std::string trainer_toml(const fs::path& root) {
  return fmt::format(R"(
[trainer]
accelerator = "cpu"
strategy = "single_device"
precision = "32-true"
max_epochs = 1
seed = {}
default_root_dir = "{}"
log_every_n_steps = 50

[[loggers]]
name = "csv"

# What a batch job gets (stdout is a log file): plain lines every 50 batches. Named explicitly so
# that running the bench on a terminal measures the same thing.
[[callbacks]]
name = "progress_bar"
style = "plain"
)",
                     kSeed, root.string());
}

RunResult run_fulgur(const Case& c, const Data& d, const std::vector<at::Tensor>& init, int64_t warmup,
                     const fs::path& root, void (*on_first_step)() = nullptr) {
  fulgur::Trainer trainer(fulgur::parse_config(trainer_toml(root), root / "bench.toml"));
  auto model = ex::make_fashion_mnist_model(model_hparams(c.arch));
  copy_parameters(*model, init);
  BenchData data(d.x.narrow(0, 0, c.steps * c.batch), d.y.narrow(0, 0, c.steps * c.batch), c.batch);
  auto probe = std::make_shared<StepProbe>(c.steps, warmup);
  probe->on_first_step = on_first_step;
  trainer.add_callback(probe);

  const Clock::time_point t0 = Clock::now();
  trainer.fit(*model, data);
  const Clock::time_point t1 = Clock::now();
  RunResult r;
  r.cpu_ms = probe->cpu_end - probe->cpu_start;
  step_times(probe->starts, probe->end, warmup, r);
  r.wall_ms = ms_between(t0, t1);
  r.steps = std::min(probe->count, trainer.global_step());
  if (probe->count != trainer.global_step()) r.steps = -1;  // batches and optimizer steps disagree
  r.final_loss = probe->last_loss.defined() ? probe->last_loss.item<double>() : NAN;
  return r;
}

std::vector<at::Tensor> initial_weights(const std::string& arch) {
  torch::manual_seed(kSeed);
  auto model = ex::make_fashion_mnist_model(model_hparams(arch));
  std::vector<at::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

// Same steps, and the same final loss up to float reassociation.
bool same_computation(const RunResult& raw, const RunResult& fulgur, int64_t steps) {
  if (raw.steps != steps || fulgur.steps != steps) return false;
  if (!std::isfinite(raw.final_loss) || !std::isfinite(fulgur.final_loss)) return false;
  return std::abs(raw.final_loss - fulgur.final_loss) <= 1e-4 * std::max(1.0, std::abs(raw.final_loss));
}

// Sends stdout (the progress bar's plain lines, the model summary) to a file while it lives, as
// in a batch job, and keeps the terminal for the table.
class StdoutToFile {
 public:
  explicit StdoutToFile(const fs::path& file) {
    std::fflush(stdout);
    saved_ = dup(STDOUT_FILENO);
    const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (saved_ < 0 || fd < 0)
      throw fulgur::Error(fulgur::ErrorKind::io, fmt::format("cannot redirect stdout to {}", file.string()));
    dup2(fd, STDOUT_FILENO);
    close(fd);
  }
  ~StdoutToFile() {
    std::fflush(stdout);
    dup2(saved_, STDOUT_FILENO);
    close(saved_);
  }
  StdoutToFile(const StdoutToFile&) = delete;
  StdoutToFile& operator=(const StdoutToFile&) = delete;

 private:
  int saved_ = -1;
};

// Not std::filesystem::remove_all: libtorch.so exports its own (GCC 13) copy, which jumps to a null
// weak reference with Debian 12's libstdc++ (see tests/test_support.h).
void remove_tree(const fs::path& root) {
  ::nftw(
      root.c_str(), [](const char* file, const struct stat*, int, FTW*) { return std::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

fs::path make_temp_root() {
  std::string pattern = (fs::temp_directory_path() / "fulgur-bench-XXXXXX").string();
  if (!mkdtemp(pattern.data()))
    throw fulgur::Error(fulgur::ErrorKind::io, fmt::format("cannot create a temporary directory {}", pattern));
  return pattern;
}

int bench_step_time(const BenchOptions& opt) {
  std::vector<Case> cases = {{"mlp", 64, 200}, {"mlp", 256, 200}, {"cnn", 64, 100}, {"cnn", 256, 40}};
  if (!opt.only.empty())
    std::erase_if(cases, [&](const Case& c) {
      return std::find(opt.only.begin(), opt.only.end(), c.arch + std::to_string(c.batch)) == opt.only.end();
    });
  for (Case& c : cases) c.steps = std::max<int64_t>(opt.warmup + 5, std::lround(c.steps * opt.steps_scale));
  int64_t max_images = 0;
  for (const Case& c : cases) max_images = std::max(max_images, c.steps * c.batch);
  const Data data = make_data(opt, max_images);
  const fs::path root = make_temp_root();

  struct Row {
    Case c;
    std::vector<RunResult> raw, fulgur;
    bool same = true;
  };
  std::vector<Row> rows;
  std::optional<StdoutToFile> quiet(std::in_place, root / "trainer-stdout.log");
  for (const Case& c : cases) {
    Row row{c, {}, {}, true};
    const std::vector<at::Tensor> init = initial_weights(c.arch);
    std::fprintf(stderr, "bench: %s batch %ld, %ld steps x %ld runs\n", c.arch.c_str(), c.batch, c.steps, opt.runs);
    for (int64_t r = 0; r < opt.runs; ++r) {
      // Alternating which side goes first cancels slow drifts (thermal, other load) between them.
      const fs::path run_root = root / fmt::format("{}{}-{}", c.arch, c.batch, r);
      if (r % 2 == 0) {
        row.raw.push_back(run_raw(c, data, init, opt.warmup));
        row.fulgur.push_back(run_fulgur(c, data, init, opt.warmup, run_root));
      } else {
        row.fulgur.push_back(run_fulgur(c, data, init, opt.warmup, run_root));
        row.raw.push_back(run_raw(c, data, init, opt.warmup));
      }
      row.same = row.same && same_computation(row.raw.back(), row.fulgur.back(), c.steps);
    }
    rows.push_back(std::move(row));
  }
  quiet.reset();
  remove_tree(root);

  auto med = [](const std::vector<RunResult>& v, double RunResult::*field) {
    std::vector<double> x;
    for (const auto& r : v) x.push_back(r.*field);
    return median(x);
  };
  std::printf("\n## Fulgur Trainer vs hand-written LibTorch loop\n\n");
  std::printf(
      "torch %s, %d intra-op thread(s), data: %s, Adam lr %g, seed %ld. Step time: median step of a run (first %ld "
      "steps left out), median over %ld interleaved runs. \"(mean)\": each run's mean step instead, which also "
      "counts periodic work (logging, progress lines every 50 steps). \"CPU\": process CPU time per step (all "
      "threads), "
      "which other load on the machine inflates far less than wall time.\n\n",
      TORCH_VERSION, at::get_num_threads(), data.source.c_str(), kLr, kSeed, opt.warmup, opt.runs);
  std::printf(
      "| model | batch | steps | raw ms/step | Fulgur ms/step | Fulgur/raw | per-run Fulgur/raw | Fulgur/raw (mean) "
      "| raw CPU ms/step | Fulgur CPU ms/step | Fulgur/raw (CPU) | Fulgur fit() ms | final loss raw | final loss "
      "Fulgur "
      "| same result |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  bool all_same = true;
  for (const Row& row : rows) {
    const double raw_ms = med(row.raw, &RunResult::step_ms);
    const double fulgur_ms = med(row.fulgur, &RunResult::step_ms);
    const double raw_cpu = med(row.raw, &RunResult::cpu_ms);
    const double fulgur_cpu = med(row.fulgur, &RunResult::cpu_ms);
    all_same = all_same && row.same;
    auto ratio = [&](double a, double b) { return row.same ? fmt::format("{:.3f}", a / b) : std::string("withheld"); };
    // Each run's two sides ran back to back: the spread of their ratios shows what noise does.
    double lo = INFINITY, hi = 0;
    for (size_t i = 0; i < row.raw.size(); ++i) {
      lo = std::min(lo, row.fulgur[i].step_ms / row.raw[i].step_ms);
      hi = std::max(hi, row.fulgur[i].step_ms / row.raw[i].step_ms);
    }
    const std::string spread = row.same ? fmt::format("{:.3f}-{:.3f}", lo, hi) : "-";
    std::printf("| %s | %ld | %ld | %.3f | %.3f | %s | %s | %s | %.3f | %.3f | %s | %.0f | %.6f | %.6f | %s |\n",
                row.c.arch.c_str(), row.c.batch, row.c.steps, raw_ms, fulgur_ms, ratio(fulgur_ms, raw_ms).c_str(),
                spread.c_str(), ratio(med(row.fulgur, &RunResult::mean_ms), med(row.raw, &RunResult::mean_ms)).c_str(),
                raw_cpu, fulgur_cpu, ratio(fulgur_cpu, raw_cpu).c_str(), med(row.fulgur, &RunResult::wall_ms),
                row.raw.back().final_loss, row.fulgur.back().final_loss,
                row.same ? "yes" : "NO: steps or final loss differ");
  }
  std::printf(
      "\nTarget: Fulgur/raw <= 1.02. \"Fulgur fit() ms\" is the whole fit() call: setup, steps, the epoch-end "
      "checkpoint and teardown.\n");
  if (!all_same) {
    std::fprintf(stderr, "bench: Fulgur and the raw loop computed different results; ratios withheld\n");
    return 1;
  }
  return 0;
}

// --startup: each side in a fresh process; the parent stamps the monotonic clock (system-wide)
// just before starting the child, the child stamps it at its first training step.
Clock::time_point g_spawn;
void report_first_step() {
  const double ms = ms_between(g_spawn, Clock::now());
  std::printf("first_step_ms %.3f\n", ms);
  std::fflush(stdout);
  // The measurement is taken; the rest of the run would only cost time.
  std::_Exit(0);
}

int probe_first_step(const BenchOptions& opt) {
  g_spawn = Clock::time_point(std::chrono::nanoseconds(opt.spawn_ns));
  const Case c{"mlp", 64, 10};
  const Data data = make_data(opt, c.steps * c.batch);
  const std::vector<at::Tensor> init = initial_weights(c.arch);
  if (opt.probe == "raw")
    run_raw(c, data, init, 0, report_first_step);
  else
    run_fulgur(c, data, init, 0, opt.probe_root, report_first_step);
  std::fprintf(stderr, "bench: probe never reached a training step\n");
  return 1;
}

int bench_startup(const BenchOptions& opt, const char* self) {
  std::vector<double> raw, fulgur;
  const std::string data = opt.data == "auto" ? "synthetic" : opt.data;
  const fs::path root = make_temp_root();
  for (int64_t r = 0; r < opt.runs; ++r) {
    for (int side = 0; side < 2; ++side) {
      const bool raw_side = (side + r) % 2 == 0;
      const int64_t now_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
      const std::string cmd =
          fmt::format("'{}' --data {} --threads {} --probe-first-step {} --probe-root '{}' --spawn-ns {} 2>/dev/null",
                      self, data, at::get_num_threads(), raw_side ? "raw" : "fulgur", root.string(), now_ns);
      std::FILE* pipe = popen(cmd.c_str(), "r");
      if (!pipe) throw fulgur::Error(fulgur::ErrorKind::runtime, "cannot start " + cmd);
      double ms = NAN;
      char line[256];
      while (std::fgets(line, sizeof line, pipe))
        if (std::sscanf(line, "first_step_ms %lf", &ms) == 1) break;
      while (std::fgets(line, sizeof line, pipe)) {
      }
      if (pclose(pipe) != 0 || std::isnan(ms)) {
        remove_tree(root);
        throw fulgur::Error(fulgur::ErrorKind::runtime, "the probe failed: " + cmd + " (run it to see why)");
      }
      (raw_side ? raw : fulgur).push_back(ms);
    }
  }
  remove_tree(root);
  std::printf("\n## Time from process start to the first training step\n\n");
  std::printf("MLP, batch 64, %s data (dataset loading left out), median of %ld interleaved process starts.\n\n",
              data.c_str(), opt.runs);
  std::printf("| side | ms to first step | min | max |\n|---|---:|---:|---:|\n");
  for (auto [name, v] : {std::pair{"raw LibTorch", &raw}, std::pair{"Fulgur Trainer", &fulgur}})
    std::printf("| %s | %.1f | %.1f | %.1f |\n", name, median(*v), *std::min_element(v->begin(), v->end()),
                *std::max_element(v->begin(), v->end()));
  std::printf("\nFulgur adds %.1f ms (config parsing, plugin discovery and loading, callbacks' setup).\n",
              median(fulgur) - median(raw));
  return 0;
}

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: bench_step_time [--startup] [--runs N] [--warmup N] [--quick] [--threads N]\n"
               "                       [--data auto|fashion|synthetic] [--only mlp64,mlp256,cnn64,cnn256]\n"
               "Compares the Fulgur Trainer with a hand-written LibTorch loop (same model, data, Adam, seed).\n"
               "  --startup   measure time from process start to the first step instead of step time\n"
               "  --runs N    interleaved runs per case (default 5)\n"
               "  --warmup N  steps left out of each run's step time (default 5)\n"
               "  --quick     a quarter of the steps (smoke test)\n"
               "  --threads N intra-op threads (default: torch's, one per core)\n");
}

}  // namespace

int main(int argc, char** argv) {
  BenchOptions opt;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw fulgur::Error(fulgur::ErrorKind::invalid_argument, fmt::format("{} needs a value", a));
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        usage(stdout);
        return 0;
      } else if (a == "--startup") {
        opt.startup = true;
      } else if (a == "--runs") {
        opt.runs = std::stol(value());
      } else if (a == "--warmup") {
        opt.warmup = std::stol(value());
      } else if (a == "--threads") {
        opt.threads = std::stol(value());
      } else if (a == "--quick") {
        opt.steps_scale = 0.25;
      } else if (a == "--data") {
        opt.data = value();
        if (opt.data != "auto" && opt.data != "fashion" && opt.data != "synthetic")
          throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--data must be auto, fashion or synthetic");
      } else if (a == "--only") {
        std::string list = value();
        for (size_t p = 0; p <= list.size();) {
          size_t q = std::min(list.find(',', p), list.size());
          opt.only.push_back(list.substr(p, q - p));
          p = q + 1;
        }
      } else if (a == "--probe-first-step") {
        opt.probe = value();
      } else if (a == "--probe-root") {
        opt.probe_root = value();
      } else if (a == "--spawn-ns") {
        opt.spawn_ns = std::stoll(value());
      } else {
        std::fprintf(stderr, "bench_step_time: unexpected argument '%s'\n", argv[i]);
        usage(stderr);
        return 2;
      }
    }
    if (opt.runs < 1) throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--runs must be >= 1");
    // On a loaded machine one thread gives steadier numbers than two fighting for cores.
    if (opt.threads > 0) at::set_num_threads(static_cast<int>(opt.threads));
    if (!opt.probe.empty()) return probe_first_step(opt);
    if (opt.startup) {
      // The child is this program; resolved here because /proc/self/exe in the shell is the shell.
      // (POSIX readlink: libtorch.so exports its own std::filesystem::read_symlink, see remove_tree.)
      std::string self(4096, '\0');
      const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
      if (n <= 0) throw fulgur::Error(fulgur::ErrorKind::io, "cannot resolve /proc/self/exe");
      self.resize(static_cast<size_t>(n));
      return bench_startup(opt, self.c_str());
    }
    return bench_step_time(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step_time: error: %s\n", e.what());
    return 1;
  }
}
