// bench_compare: the C++ sides of bench/compare.sh. One process runs one side once and prints one
// line "BENCH_RESULT {json}" that bench/python/compare.py collects:
//
//   bench_compare --side raw|fulgur|fulgur-bare|fulgur-graphs --model mlp|cnn|gpt --batch B --steps N
//                 [--warmup W] [--pool P] [--device cpu|cuda] [--threads T] [--root DIR] [--spawn-ns NS]
//                 [--dtype float32|float64] [--precision 32-true|bf16-mixed|16-mixed]
//
//   raw            a hand-written LibTorch loop (narrow, forward, cross_entropy, zero_grad, backward, step)
//   fulgur         the Trainer with its default plugins (csv logger, model summary, checkpoint at epoch
//                  end; progress bar only on a terminal)
//   fulgur-bare    the Trainer with barebones = true (no loggers, callbacks or profiler)
//   fulgur-graphs  `fulgur` with cuda_graphs = "on": the step captured once and replayed (cuda only;
//                  bench/cuda_graphs.sh compares it with `fulgur`)
//
// --precision bf16-mixed: the raw loop runs its forward under bf16 autocast, the Trainer uses the
// bf16-mixed plugin (float32 weights and optimizer either way). --precision 16-mixed: float16
// autocast on CUDA (bf16 elsewhere, as the plugin) with dynamic loss scaling; the raw loop scales
// as a hand-written LibTorch loop does (C++ has no GradScaler): torch's AMP kernels for the unscale,
// the inf check and the scale update, and the skip decided by reading the flag on the host each
// step, where the Trainer decides it on the device (fused Adam).
//
// Data, initial weights and dropout masks are derived exactly as bench/python/models.py derives
// them (seeded torch generators of the same libtorch, parameters initialised by sorted name), so
// the first loss is bit-identical across C++ and Python and the final loss differs only by
// rounding (C++ and Python Adam order their float operations differently). --dtype float64 runs
// the same program in double precision (Trainer: precision "64-true"): there that rounding stays
// far below anything a real difference in the work would cause, which compare.py checks.
#include "fashion_mnist.h"

#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace ex = fulgur::examples;
using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC, the clock of Python's time.monotonic_ns

// Shared with bench/python/models.py: change both or the same-work check fails.
constexpr int64_t kDataSeed = 1234;
constexpr int64_t kWeightSeed = 4321;
constexpr int64_t kDropoutSeed = 42;
constexpr double kLr = 1e-3;
constexpr int64_t kGptVocab = 256;
constexpr int64_t kGptSeq = 64;
constexpr int64_t kGptDim = 128;
constexpr int64_t kGptHeads = 4;
constexpr int64_t kGptLayers = 2;

struct Options {
  std::string side;
  std::string model;
  int64_t batch = 64;
  int64_t steps = 100;
  int64_t warmup = 10;
  int64_t pool = 16;  // distinct batches, served cyclically (keeps memory small at any step count)
  std::string device = "cpu";
  int64_t threads = 0;
  std::string root;
  int64_t spawn_ns = 0;
  std::string dtype = "float32";
  std::string precision = "32-true";
};

// The raw loop's forward under autocast (what the mixed precision plugins do for the Trainer).
class RawAutocast {
 public:
  RawAutocast(const Options& o) : type_(torch::Device(o.device).type()), on_(o.precision != "32-true") {
    if (!on_) return;
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(
        type_, o.precision == "16-mixed" && type_ == c10::DeviceType::CUDA ? at::kHalf : at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~RawAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, false);
  }

 private:
  c10::DeviceType type_;
  bool on_;
};

// The raw loop's loss scaling under 16-mixed (GradScaler's defaults: 65536, x2 every 2000 finite
// steps, x0.5 after a non-finite one), written with torch's AMP kernels.
class RawLossScaler {
 public:
  RawLossScaler(bool on, const torch::Device& device) : on_(on) {
    if (!on_) return;
    scale_ = torch::full({}, 65536.0, torch::TensorOptions().dtype(torch::kFloat).device(device));
    tracker_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kInt).device(device));
  }
  at::Tensor scale(const at::Tensor& loss) const { return on_ ? loss * scale_ : loss; }
  // Unscales the gradients and updates the scale; whether the step may be taken (read on the host).
  bool unscale_and_check(torch::optim::Optimizer& optimizer) {
    if (!on_) return true;
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) grads.push_back(p.grad());
    at::Tensor found_inf = torch::zeros({}, scale_.options());
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                   scale_.to(torch::kDouble).reciprocal().to(torch::kFloat));
    at::_amp_update_scale_(scale_, tracker_, found_inf, 2.0, 0.5, 2000);
    return found_inf.item<float>() == 0.0f;
  }

 private:
  bool on_;
  at::Tensor scale_, tracker_;
};

double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// ---------------------------------------------------------------------------------------------
// Data: `pool` batches from a seeded generator, the same tensors bench/python/models.py makes.

struct Pool {
  at::Tensor x, y;
  int64_t batches = 0, batch = 0;
  std::pair<at::Tensor, at::Tensor> at(int64_t step) const {
    const int64_t j = step % batches;
    return {x.narrow(0, j * batch, batch), y.narrow(0, j * batch, batch)};
  }
};

Pool make_pool(const std::string& model, int64_t batch, int64_t batches) {
  const int64_t n = batch * batches;
  auto gen = at::detail::createCPUGenerator(kDataSeed);
  Pool p{{}, {}, batches, batch};
  if (model == "gpt") {
    // Arithmetic sequences mod vocab: learnable from two tokens of context, so the loss falls.
    at::Tensor start = torch::randint(0, kGptVocab, {n, 1}, gen, torch::kInt64);
    at::Tensor stride = torch::randint(1, 8, {n, 1}, gen, torch::kInt64);
    at::Tensor tokens = (start + torch::arange(kGptSeq + 1, torch::kInt64) * stride).remainder(kGptVocab);
    p.x = tokens.narrow(1, 0, kGptSeq).contiguous();
    p.y = tokens.narrow(1, 1, kGptSeq).contiguous();
  } else {
    // Fashion-MNIST-sized images; the label is the argmax of the first ten pixels (learnable).
    p.x = torch::randn({n, 1, 28, 28}, gen);
    p.y = p.x.view({n, -1}).narrow(1, 0, 10).argmax(1);
  }
  return p;
}

double data_checksum(const Pool& p) {
  return p.x.to(torch::kDouble).abs().sum().item<double>() + p.y.to(torch::kDouble).sum().item<double>();
}

// ---------------------------------------------------------------------------------------------
// A small GPT: token + positional embedding, pre-LayerNorm blocks with causal self-attention
// (scaled_dot_product_attention) and a GELU MLP, final LayerNorm, LM head. Parameter names and
// shapes match GPT in bench/python/models.py.

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, 4 * d));
    fc_out = register_module("fc_out", torch::nn::Linear(4 * d, d));
  }
  at::Tensor forward(at::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto split = qkv->forward(ln1->forward(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
    at::Tensor a = at::scaled_dot_product_attention(split[0], split[1], split[2], /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                    /*is_causal=*/true);
    x = x + proj->forward(a.transpose(1, 2).reshape({b, t, d}));
    return x + fc_out->forward(torch::gelu(fc->forward(ln2->forward(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_out{nullptr};
};
TORCH_MODULE(Block);

// A fulgur::Module, so the same object runs in the raw loop and under the Trainer.
class Gpt : public fulgur::Module {
 public:
  Gpt() {
    tok_emb = register_module("tok_emb", torch::nn::Embedding(kGptVocab, kGptDim));
    pos_emb = register_module("pos_emb", torch::nn::Embedding(kGptSeq, kGptDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kGptLayers; ++i) blocks->push_back(Block(kGptDim, kGptHeads));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kGptDim})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kGptDim, kGptVocab).bias(false)));
  }
  // Logits [B, T, vocab] for tokens [B, T].
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = tok_emb->forward(tokens) + pos_emb->forward(torch::arange(tokens.size(1), tokens.options()));
    for (const auto& block : *blocks) x = block->as<Block>()->forward(x);
    return head->forward(ln_f->forward(x));
  }
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) {
    return torch::nn::functional::cross_entropy(forward(tokens).view({-1, kGptVocab}), targets.view({-1}));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    at::Tensor l = loss(batch.input, batch.target);
    log("train/loss", l, fulgur::LogOptions().prog_bar(true));  // as the Fashion-MNIST models do
    return {l};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {
        fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(kLr)))};
  }

  torch::nn::Embedding tok_emb{nullptr}, pos_emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};

// The model of a case as a fulgur::Module, plus a loss function for the raw loop.
struct Model {
  std::shared_ptr<fulgur::Module> module;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
};

Model make_model(const std::string& name) {
  if (name == "gpt") {
    auto gpt = std::make_shared<Gpt>();
    return {gpt, [g = gpt.get()](const at::Tensor& x, const at::Tensor& y) { return g->loss(x, y); }};
  }
  fulgur::Options hp("[model]");
  hp.set("arch", name).set("optimizer", std::string("adam")).set("lr", kLr);
  auto clf = ex::make_fashion_mnist_model(hp);
  return {clf, [c = clf.get()](const at::Tensor& x, const at::Tensor& y) {
            return torch::nn::functional::cross_entropy(c->forward(x), y);
          }};
}

// Parameters by sorted name, each from its own seeded generator (the order in which a language
// registers them does not matter): matrices randn / sqrt(fan_in), 1-D weights (LayerNorm) one,
// biases zero.
void init_weights(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> by_name;
  for (const auto& item : m.named_parameters()) by_name.emplace(item.key(), item.value());
  int64_t k = 0;
  for (auto& [name, p] : by_name) {
    auto gen = at::detail::createCPUGenerator(kWeightSeed + k++);
    if (p.dim() >= 2) {
      const double fan_in = static_cast<double>(p.numel() / p.size(0));
      p.copy_(torch::randn(p.sizes(), gen) / std::sqrt(fan_in));
    } else if (name.ends_with("weight")) {
      p.fill_(1.0);
    } else {
      p.zero_();
    }
  }
}

double weight_checksum(torch::nn::Module& m) {
  double s = 0;
  for (const auto& p : m.parameters()) s += p.detach().to(torch::kCPU, torch::kDouble).abs().sum().item<double>();
  return s;
}

// ---------------------------------------------------------------------------------------------
// Measurement, identical for every side (and mirrored in bench/python/models.py::Meter).

struct Meter {
  Meter(int64_t steps, int64_t warmup, int64_t spawn_ns)
      : starts(steps), warmup(warmup), spawn(Clock::time_point(std::chrono::nanoseconds(spawn_ns))) {}

  // At the start of step i, before anything of the step runs. `previous_loss` is read to wait for
  // the device (a no-op wait on the CPU) so the timed window holds whole steps.
  void step_start(int64_t i, const at::Tensor& previous_loss) {
    if (i == 0) {
      first_step = Clock::now();
      // Both languages reseed here: dropout draws the same masks whatever a framework did with
      // the generator before (Lightning's DataLoader draws a base seed from it, for instance).
      torch::manual_seed(kDropoutSeed);
    }
    if (i == warmup) {
      if (previous_loss.defined()) previous_loss.item<double>();
      cpu_start = process_cpu_s();
      timed_start = Clock::now();
    }
    starts[i] = Clock::now();
  }
  void step_end(int64_t i, const at::Tensor& loss) {
    ++count;
    if (i == 0) first_loss = loss.item<double>();  // outside the timed window (warmup >= 1)
    if (i + 1 == static_cast<int64_t>(starts.size())) {
      final_loss = loss.item<double>();
      end = Clock::now();
      cpu_end = process_cpu_s();
    }
  }

  std::string json(const std::string& side, const Options& o, double data_sum, double init_sum) const {
    const int64_t timed = static_cast<int64_t>(starts.size()) - warmup;
    std::vector<double> us;
    for (size_t i = warmup; i < starts.size(); ++i)
      us.push_back(
          std::chrono::duration<double, std::micro>((i + 1 < starts.size() ? starts[i + 1] : end) - starts[i]).count());
    std::sort(us.begin(), us.end());
    const double window_s = std::chrono::duration<double>(end - timed_start).count();
    return fmt::format(
        R"({{"side": "{}", "model": "{}", "batch": {}, "device": "{}", "threads": {}, "steps": {}, "first_loss": {:.17g}, )"
        R"("final_loss": {:.17g}, "steps_per_s": {:.6f}, "median_step_us": {:.3f}, "cpu_us_per_step": {:.3f}, )"
        R"("first_step_ms": {:.3f}, "peak_rss_mib": {:.1f}, "data_sum": {:.17g}, "init_sum": {:.17g}, "precision": "{}"}})",
        side, o.model, o.batch, o.device, at::get_num_threads(), count, first_loss, final_loss,
        static_cast<double>(timed) / window_s, us[us.size() / 2],
        (cpu_end - cpu_start) * 1e6 / static_cast<double>(timed),
        std::chrono::duration<double, std::milli>(first_step - spawn).count(), peak_rss_mib(), data_sum, init_sum,
        o.precision);
  }

  std::vector<Clock::time_point> starts;  // preallocated: no allocation inside the loop
  int64_t warmup;
  Clock::time_point spawn, first_step, timed_start, end;
  double cpu_start = 0, cpu_end = 0;
  double first_loss = NAN, final_loss = NAN;
  int64_t count = 0;
};

// ---------------------------------------------------------------------------------------------
// Side 1: the hand-written loop.

void run_raw(const Options& o, Model& m, const Pool& pool, Meter& meter) {
  const torch::Device device(o.device);
  const bool f64 = o.dtype == "float64";
  m.module->to(device, f64 ? torch::kDouble : torch::kFloat);
  m.module->train();
  torch::optim::Adam optimizer(m.module->parameters(), torch::optim::AdamOptions(kLr));
  RawLossScaler scaler(o.precision == "16-mixed", device);
  at::Tensor loss;
  for (int64_t i = 0; i < o.steps; ++i) {
    meter.step_start(i, loss);
    auto [x, y] = pool.at(i);
    {
      RawAutocast autocast(o);
      loss = m.loss(f64 && x.is_floating_point() ? x.to(device, torch::kDouble) : x.to(device), y.to(device));
    }
    optimizer.zero_grad();
    scaler.scale(loss).backward();
    if (scaler.unscale_and_check(optimizer)) optimizer.step();
    meter.step_end(i, loss);
  }
}

// ---------------------------------------------------------------------------------------------
// Sides 2 and 3: the Trainer.

// Serves the pool cyclically, `steps` batches per epoch: what a user's in-memory loader does.
class PoolLoader : public fulgur::BatchLoader {
 public:
  PoolLoader(const Pool& pool, int64_t steps) : pool_(pool), steps_(steps) {}
  int64_t num_batches() const override { return steps_; }
  void start_epoch(int64_t, int64_t skip) override { next_ = skip; }
  std::optional<fulgur::Batch> next() override {
    if (next_ >= steps_) return std::nullopt;
    auto [x, y] = pool_.at(next_++);
    return fulgur::Batch{x, y, {}};
  }
  void set_replica(int64_t, int64_t) override {}  // single process

 private:
  const Pool& pool_;
  int64_t steps_;
  int64_t next_ = 0;
};

class PoolData : public fulgur::DataModule {
 public:
  PoolData(const Pool& pool, int64_t steps) : pool_(pool), steps_(steps) {}
  std::unique_ptr<fulgur::BatchLoader> train_loader() override { return std::make_unique<PoolLoader>(pool_, steps_); }

 private:
  const Pool& pool_;
  int64_t steps_;
};

// Feeds the Meter from the Trainer's hooks; batch transfer has already run at batch start, as in
// Lightning, so both frameworks time the same span.
class MeterCallback : public fulgur::Callback {
 public:
  explicit MeterCallback(Meter& meter) : meter_(meter) {}
  fulgur::HookSet hooks() const override { return fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end; }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t i) override {
    meter_.step_start(i, last_loss_);
  }
  void on_train_batch_end(fulgur::TrainerContext&, const fulgur::StepOutput& out, const fulgur::Batch&,
                          int64_t i) override {
    last_loss_ = out.loss;
    meter_.step_end(i, out.loss);
  }

 private:
  Meter& meter_;
  at::Tensor last_loss_;
};

std::string trainer_toml(const Options& o, bool barebones, bool graphs) {
  // The defaults a user gets, spelled out: csv logger, model summary and a checkpoint at epoch end;
  // the progress bar only on a terminal (Lightning's run in compare.py does the same).
  return fmt::format(R"(
[trainer]
accelerator = "{}"
strategy = "single_device"
precision = "{}"
max_epochs = 1
seed = {}
default_root_dir = "{}"
log_every_n_steps = 50
enable_progress_bar = {}
barebones = {}
cuda_graphs = "{}"
{}
)",
                     o.device == "cpu" ? "cpu" : "cuda", o.dtype == "float64" ? "64-true" : o.precision, kDropoutSeed,
                     o.root, isatty(STDOUT_FILENO) ? "true" : "false", barebones ? "true" : "false",
                     graphs ? "on" : "off", barebones ? "" : "[[loggers]]\nname = \"csv\"\n");
}

void run_fulgur(const Options& o, Model& m, const Pool& pool, Meter& meter, bool barebones, bool graphs) {
  fulgur::Trainer trainer(
      fulgur::parse_config(trainer_toml(o, barebones, graphs), std::string(o.root) + "/bench.toml"));
  trainer.add_callback(std::make_shared<MeterCallback>(meter));
  PoolData data(pool, o.steps);
  trainer.fit(*m.module, data);
  if (trainer.global_step() != meter.count) meter.count = -1;  // batches and optimizer steps disagree
}

int run(const Options& o) {
  if (o.threads > 0) at::set_num_threads(static_cast<int>(o.threads));
  if (o.warmup < 1 || o.steps <= o.warmup)
    throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "need 1 <= --warmup < --steps");
  Meter meter(o.steps, o.warmup, o.spawn_ns);
  const Pool pool = make_pool(o.model, o.batch, std::min(o.pool, o.steps));
  Model m = make_model(o.model);
  init_weights(*m.module);
  const double data_sum = data_checksum(pool);
  const double init_sum = weight_checksum(*m.module);
  if (o.side == "raw")
    run_raw(o, m, pool, meter);
  else if (o.side == "fulgur" || o.side == "fulgur-bare" || o.side == "fulgur-graphs")
    run_fulgur(o, m, pool, meter, o.side == "fulgur-bare", o.side == "fulgur-graphs");
  else
    throw fulgur::Error(fulgur::ErrorKind::invalid_argument,
                        "--side must be raw, fulgur, fulgur-bare or fulgur-graphs");
  std::printf("BENCH_RESULT %s\n", meter.json(o.side, o, data_sum, init_sum).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.spawn_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw fulgur::Error(fulgur::ErrorKind::invalid_argument, fmt::format("{} needs a value", a));
        return argv[++i];
      };
      if (a == "--side")
        o.side = value();
      else if (a == "--model")
        o.model = value();
      else if (a == "--batch")
        o.batch = std::stol(value());
      else if (a == "--steps")
        o.steps = std::stol(value());
      else if (a == "--warmup")
        o.warmup = std::stol(value());
      else if (a == "--pool")
        o.pool = std::stol(value());
      else if (a == "--device")
        o.device = value();
      else if (a == "--threads")
        o.threads = std::stol(value());
      else if (a == "--root")
        o.root = value();
      else if (a == "--spawn-ns")
        o.spawn_ns = std::stoll(value());
      else if (a == "--dtype")
        o.dtype = value();
      else if (a == "--precision")
        o.precision = value();
      else
        throw fulgur::Error(fulgur::ErrorKind::invalid_argument, fmt::format("unexpected argument '{}'", a));
    }
    if (o.model != "mlp" && o.model != "cnn" && o.model != "gpt")
      throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--model must be mlp, cnn or gpt");
    if (o.dtype != "float32" && o.dtype != "float64")
      throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--dtype must be float32 or float64");
    if (o.precision != "32-true" && o.precision != "bf16-mixed" && o.precision != "16-mixed")
      throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--precision must be 32-true, bf16-mixed or 16-mixed");
    if (o.precision != "32-true" && o.dtype == "float64")
      throw fulgur::Error(fulgur::ErrorKind::invalid_argument,
                          fmt::format("--precision {} runs in --dtype float32", o.precision));
    if (o.side != "raw" && o.root.empty())
      throw fulgur::Error(fulgur::ErrorKind::invalid_argument, "--root DIR is needed for the Trainer's output");
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_compare: error: %s\n", e.what());
    return 1;
  }
}
