// bench_step_probe: a callback plugin for bench/distributed.sh. After every training batch it
// prints one line to stderr on every rank:
//   FULGUR_STEP rank=R step=I t=SECONDS loss=L wchar=BYTES rss_kib=KIB minflt=N cpu=SECONDS
// t is CLOCK_MONOTONIC (std::chrono::steady_clock, Python's time.monotonic()), so the driver
// measures start-to-first-step against the moment it started the process; wchar is the bytes this
// process has passed to write(2)/writev(2) (/proc/self/io), which on Gloo is the bytes it sent on
// its sockets (Gloo's TCP pairs write with writev); rss_kib, minflt and cpu (user + system time of
// all its threads) are getrusage(RUSAGE_SELF). CPU time per step is what a shared, loaded machine
// distorts least: wall time there depends on what else runs.
// The Lightning side (bench/python/gpt_lightning.py) prints the same line from a Callback.
// With memory = true every rank also prints, once, at the second step (the optimizer's state
// exists then):
//   FULGUR_MEMORY rank=R parameters=BYTES gradients=BYTES optimizer=BYTES activations=BYTES
// parameters and gradients: this rank's tensors (its shards under tensor parallelism);
// optimizer: every tensor of its optimizers' per-parameter state (AdamW: exp_avg, exp_avg_sq);
// activations: the heap bytes (glibc mallinfo2, all arenas, mmapped blocks included) that forward
// left alive when backward starts, less those alive when the batch started: what autograd saved.
// With save_init set, rank 0 also writes the model's parameters as they are before the first step
// to that .safetensors file (the Python model loads them: the same initial weights on both sides).
#include <fulgur/plugin.h>
#include <fulgur/weights.h>

#include <fmt/format.h>
#include <malloc.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>

namespace {

long long proc_io_wchar() {
  std::ifstream in("/proc/self/io");
  std::string key;
  long long value = 0;
  while (in >> key >> value)
    if (key == "wchar:") return value;
  return -1;
}

// Bytes malloc has handed out and not had back, in every arena.
long long heap_in_use() {
  const struct mallinfo2 info = ::mallinfo2();
  return static_cast<long long>(info.uordblks + info.hblkhd);
}

long long bytes_of(const at::Tensor& t) { return t.defined() ? static_cast<long long>(t.nbytes()) : 0; }

double seconds(const timeval& tv) { return static_cast<double>(tv.tv_sec) + 1e-6 * static_cast<double>(tv.tv_usec); }

class StepProbe final : public fulgur::CallbackBase<StepProbe> {
 public:
  FULGUR_OPTIONS(Options,
                 (string, save_init, "Rank 0 writes the initial parameters here (.safetensors); \"\" = no", "\"\""),
                 (boolean, memory, "Print this rank's parameter, gradient, optimizer and activation bytes once",
                  false));

  explicit StepProbe(const Options& options) : save_init_(options.save_init), memory_(options.memory) {}

  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    if (memory_ && step_ == 1) heap_at_start_ = heap_in_use();
  }

  void on_before_backward(fulgur::TrainerContext&, const at::Tensor&) override {
    if (memory_ && step_ == 1) activations_ = heap_in_use() - heap_at_start_;
  }

  void on_before_optimizer_step(fulgur::TrainerContext& trainer, torch::optim::Optimizer&) override {
    if (!memory_ || step_ != 1) return;
    long long parameters = 0, gradients = 0, optimizer = 0;
    // Parameters by the storage they hold: a sharding strategy's optimizers step this rank's rows,
    // views of the parameters (ZeRO-1/2, counted once) or tensors of their own while the whole
    // parameters' storage is freed between uses (ZeRO-3); the rows' gradients are the ones kept.
    std::set<const void*> model_parameters, model_storages;
    for (const at::Tensor& p : trainer.model().parameters()) {
      if (p.has_storage() && p.storage().nbytes() > 0) parameters += bytes_of(p);  // 0: freed
      gradients += bytes_of(p.grad());
      model_parameters.insert(p.unsafeGetTensorImpl());
      if (p.has_storage()) model_storages.insert(p.storage().unsafeGetStorageImpl());
    }
    for (torch::optim::Optimizer* o : trainer.optimizers())
      for (const auto& group : o->param_groups())
        for (const at::Tensor& p : group.params()) {
          if (model_parameters.contains(p.unsafeGetTensorImpl())) continue;
          if (!(p.has_storage() && model_storages.contains(p.storage().unsafeGetStorageImpl())))
            parameters += bytes_of(p);  // rows of their own, not a view of a parameter
          gradients += bytes_of(p.grad());
        }
    for (torch::optim::Optimizer* o : trainer.optimizers())
      for (const auto& [key, state] : o->state())
        if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get()))
          optimizer += bytes_of(adamw->exp_avg()) + bytes_of(adamw->exp_avg_sq()) + bytes_of(adamw->max_exp_avg_sq());
        else if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state.get()))
          optimizer += bytes_of(adam->exp_avg()) + bytes_of(adam->exp_avg_sq()) + bytes_of(adam->max_exp_avg_sq());
    const std::string line =
        fmt::format("FULGUR_MEMORY rank={} parameters={} gradients={} optimizer={} activations={}\n",
                    trainer.cluster().global_rank, parameters, gradients, optimizer, activations_);
    std::fputs(line.c_str(), stderr);
  }

  void on_train_start(fulgur::TrainerContext& trainer) override {
    if (save_init_.empty() || !trainer.is_global_zero()) return;
    fulgur::save_safetensors(fulgur::named_tensors(trainer.model()), save_init_, {{"format", "pt"}});
  }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput& out, const fulgur::Batch&,
                          int64_t) override {
    const double loss = out.loss.defined() ? out.loss.detach().to(torch::kFloat64).item<double>() : 0.0;
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    const std::string line =
        fmt::format("FULGUR_STEP rank={} step={} t={:.6f} loss={:.8f} wchar={} rss_kib={} minflt={} cpu={:.6f}\n",
                    trainer.cluster().global_rank, step_++, t, loss, proc_io_wchar(), ru.ru_maxrss, ru.ru_minflt,
                    seconds(ru.ru_utime) + seconds(ru.ru_stime));
    std::fputs(line.c_str(), stderr);
  }

 private:
  std::string save_init_;
  bool memory_ = false;
  int64_t step_ = 0;
  long long heap_at_start_ = 0, activations_ = 0;
};

}  // namespace

FULGUR_PLUGIN(StepProbe, "bench_step_probe", "1.0.0",
              "bench/distributed.sh: per-step time, loss, bytes written and RSS of every rank on stderr")
