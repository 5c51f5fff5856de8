// Data-parallel training with real processes over loopback Gloo: Fulgur's launcher (devices = 2)
// and torchrun start the same worker binary (tests/ddp_worker.cpp). Plus the pieces in-process:
// cluster-environment detection for each launcher and the distributed sampler's coverage.
#include <fulgur/cluster_environment.h>
#include <fulgur/data.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/tar_shards.h>
#include <fulgur/error.h>

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "../core/src/distributed/nccl_backend.h"
#include "test_support.h"
#include "training_job.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fulgur/checkpoint_io.h>
#include <fulgur/sample_position.h>

namespace {

using fulgur::test::contains;
using fulgur::test::TempDir;
namespace fs = std::filesystem;

struct ProcessResult {
  int status = -1;  // exit status, or -signal
  bool timed_out = false;
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

// Starts a command in its own process group (so that it and every rank it launches can be
// signalled together), with extra environment variables, output to `log`, run from log's folder
// (relative paths of the run, like checkpoint dirs, land next to its log).
pid_t spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const fs::path& log) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setpgid(0, 0);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    if (chdir(log.parent_path().c_str()) != 0) _exit(126);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  setpgid(pid, pid);
  return pid;
}

// Runs a command to its end; kills the whole group if it outlives `timeout`, so that a hang
// fails the test instead of blocking CI.
ProcessResult run_process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                          const fs::path& log, std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = spawn(args, env, log);
  ProcessResult result;
  int status = 0;
  for (;;) {
    if (waitpid(pid, &status, WNOHANG) == pid) break;
    if (std::chrono::steady_clock::now() - start > timeout) {
      result.timed_out = true;
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(-pid, SIGKILL);  // nothing of the run may outlive it
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  result.output = fulgur::test::read_bytes(log);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// Environment for runs that must not inherit a launcher's variables from whoever runs the tests.
std::map<std::string, std::string> clean_env() {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "FULGUR_LAUNCHER", "SLURM_NTASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"})
    unsetenv(v);
  return {{"OMP_NUM_THREADS", "1"}};
}

// `strategy` "fsdp:N" selects fsdp with zero_stage = N.
std::string worker_config(std::string strategy, const std::string& devices, int64_t batch, int64_t max_steps,
                          int64_t accumulate = 1, bool shuffle = false) {
  std::string strategy_table = "\n[strategy]\ntimeout = 30.0\n";
  if (strategy.starts_with("fsdp:")) {
    strategy_table += "zero_stage = " + strategy.substr(5) + "\n";
    strategy = "fsdp";
  } else if (strategy != "ddp") {
    strategy_table.clear();
  }
  return fmt::format(R"(
[trainer]
accelerator = "cpu"
strategy = "{}"
devices = "{}"
max_steps = {}
max_epochs = 100
seed = 7
accumulate_grad_batches = {}
num_sanity_val_steps = 0
limit_val_batches = 2
val_check_interval = 1.0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
{}
[data]
batch_size = {}
shuffle = {}
)",
                     strategy, devices, max_steps, accumulate, strategy_table, batch, shuffle);
}

// Appended to a worker_config: a checkpoint every 4 optimizer steps, all kept, as ckpts/step=N.ckpt.
constexpr const char* kCheckpointEvery4Steps = R"(
[[callbacks]]
name = "model_checkpoint"
dirpath = "ckpts"
filename = "{step}"
every_n_train_steps = 4
save_top_k = -1
)";

// `toml` (from worker_config) with one more line in its [strategy] table.
std::string with_strategy_option(std::string toml, const std::string& line) {
  toml.replace(toml.find("timeout = 30.0"), 14, "timeout = 30.0\n" + line);
  return toml;
}

struct Run {
  TempDir dir;
  fs::path config;
  ProcessResult result;
};

std::unique_ptr<Run> run_worker(const std::string& toml, std::vector<std::string> extra_args = {},
                                std::map<std::string, std::string> env = clean_env(), bool torchrun = false) {
  auto run = std::make_unique<Run>();
  run->config = run->dir / "run.toml";
  fulgur::test::write_bytes(run->config, toml);
  std::vector<std::string> args;
  if (torchrun)
    args = {FULGUR_TEST_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python"};
  args.push_back(FULGUR_TEST_DDP_WORKER);
  args.push_back(run->config.string());
  args.push_back(run->dir.path().string());
  for (auto& a : extra_args) args.push_back(std::move(a));
  run->result = run_process(args, env, run->dir / "output.log");
  return run;
}

std::vector<at::Tensor> weights(const Run& run, int rank) {
  std::vector<at::Tensor> w;
  torch::load(w, (run.dir / fmt::format("weights_rank{}.pt", rank)).string());
  return w;
}

double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

std::map<std::string, double> metrics(const Run& run, int rank) {
  std::ifstream in(run.dir / fmt::format("metrics_rank{}.txt", rank));
  std::map<std::string, double> m;
  std::string key;
  double value;
  while (in >> key >> value) m[key] = value;
  return m;
}

#define REQUIRE_SUCCESS(run) REQUIRE_MESSAGE((run)->result.status == 0, (run)->result.output)

}  // namespace

TEST_CASE("ddp: 2 ranks with batch B reach the weights of 1 process with batch 2B") {
  // The single process validates on 4 batches: the 2 each of the two ranks see (the metric checks).
  std::string single_config = worker_config("single_device", "1", 16, 6);
  REQUIRE(fulgur::test::replace_all(single_config, "limit_val_batches = 2", "limit_val_batches = 4") == 1);
  auto single = run_worker(single_config);
  REQUIRE_SUCCESS(single);
  auto env = clean_env();
  env["FULGUR_TEST_SCRAMBLE_INIT"] = "1";  // rank 1 starts from other weights: rank 0's must win
  auto ddp = run_worker(worker_config("ddp", "2", 8, 6), {}, env);
  REQUIRE_SUCCESS(ddp);
  CHECK(contains(ddp->result.output, "Fulgur launcher: started 2 processes"));
  CHECK(max_difference(weights(*ddp, 0), weights(*ddp, 1)) == 0.0);  // replicas stay identical
  CHECK(max_difference(weights(*ddp, 0), weights(*single, 0)) < 1e-5);
  const auto m0 = metrics(*ddp, 0), m1 = metrics(*ddp, 1);
  CHECK(m0.at("global_step") == 6);
  CHECK(m1.at("global_step") == 6);
  // sync_dist: a value that differs per rank is the same mean on both.
  CHECK(m0.at("val/rank") == doctest::Approx(0.5));
  CHECK(m1.at("val/rank") == doctest::Approx(0.5));
  CHECK(m0.at("val/loss") == doctest::Approx(m1.at("val/loss")).epsilon(1e-6));
  // Metric objects (fulgur/metrics.h) synced through the strategy: each rank saw half of the
  // validation batches, both log the value over all of them, which is what one process computes.
  const auto one = metrics(*single, 0);
  for (const char* key : {"val/acc_metric", "val/auroc_metric"}) {
    INFO(std::string(key) << ": rank 0 " << m0.at(key) << ", rank 1 " << m1.at(key) << ", one process " << one.at(key));
    CHECK(m0.at(key) == m1.at(key));
    CHECK(m0.at(key) == doctest::Approx(one.at(key)).epsilon(1e-4));
  }
}

TEST_CASE("#34.3 a step-level value logged with sync_dist is reduced across ranks when logged, as in Lightning") {
  auto env = clean_env();
  env["FULGUR_TEST_LOG_RANK_STEP"] = "1";  // each rank logs rank + 1 at every training step, on_step only
  auto ddp = run_worker(worker_config("ddp", "2", 8, 6), {}, env);
  REQUIRE_SUCCESS(ddp);
  const auto m0 = metrics(*ddp, 0), m1 = metrics(*ddp, 1);
  REQUIRE(m0.contains("train/rank"));
  // Before the fix only epoch aggregates were synced: rank 0 held 1, rank 1 held 2.
  CHECK(m0.at("train/rank") == doctest::Approx(1.5));
  CHECK(m1.at("train/rank") == doctest::Approx(1.5));
}

TEST_CASE("#34.15 use_distributed_sampler = false gives every rank the whole loader, as in Lightning") {
  // 96 samples, batch 8, one epoch: a rank's half is 6 steps, the whole loader 12.
  auto steps_in_one_epoch = [](bool shard) {
    std::string toml = worker_config("ddp", "2", 8, 1000);
    const size_t at = toml.find("max_epochs = 100");
    REQUIRE(at != std::string::npos);
    toml.replace(at, 16, fmt::format("max_epochs = 1\nuse_distributed_sampler = {}", shard));
    auto run = run_worker(toml);
    REQUIRE_SUCCESS(run);
    CHECK(metrics(*run, 0).at("global_step") == metrics(*run, 1).at("global_step"));
    return metrics(*run, 0).at("global_step");
  };
  CHECK(steps_in_one_epoch(true) == 6);
  CHECK(steps_in_one_epoch(false) == 12);
}

// `config` with one more [trainer] line.
std::string with_trainer_line(std::string config, const std::string& line) {
  const std::string at = "logger = false\n";
  config.replace(config.find(at), at.size(), at + line + "\n");
  return config;
}

TEST_CASE("#34.15 sync_batchnorm: 2 ranks with batch B normalize and train as 1 process with batch 2B") {
  // The worker's MLP with a fulgur::nn::BatchNorm after its first layer. Weights here include the
  // running mean and variance. Without synchronization each rank normalizes with its own half of
  // the batch, which one process never does: the last check shows the comparison can tell.
  auto env = clean_env();
  env["FULGUR_TEST_BATCH_NORM"] = "fulgur";
  auto single =
      run_worker(with_trainer_line(worker_config("single_device", "1", 16, 6), "sync_batchnorm = true"), {}, env);
  REQUIRE_SUCCESS(single);
  CHECK(contains(single->result.output, "sync_batchnorm: one process"));
  for (const char* strategy : {"ddp", "fsdp:2"}) {
    CAPTURE(strategy);
    auto synced = run_worker(with_trainer_line(worker_config(strategy, "2", 8, 6), "sync_batchnorm = true"), {}, env);
    REQUIRE_SUCCESS(synced);
    CHECK(
        contains(synced->result.output, "1 fulgur::nn::BatchNorm layer normalize with the statistics of all 2 ranks"));
    CHECK(max_difference(weights(*synced, 0), weights(*synced, 1)) == 0.0);
    CHECK(max_difference(weights(*synced, 0), weights(*single, 0)) < 1e-5);
  }
  auto local = run_worker(worker_config("ddp", "2", 8, 6), {}, env);
  REQUIRE_SUCCESS(local);
  CHECK(max_difference(weights(*local, 0), weights(*single, 0)) > 1e-4);
}

TEST_CASE("#34.15 sync_batchnorm refuses torch::nn::BatchNorm layers, naming them and the layer to use") {
  auto env = clean_env();
  env["FULGUR_TEST_BATCH_NORM"] = "torch";
  auto run = run_worker(with_trainer_line(worker_config("ddp", "2", 8, 2), "sync_batchnorm = true"), {}, env);
  CHECK(run->result.status != 0);
  CHECK(contains(run->result.output,
                 "sync_batchnorm = true: the model's batch-norm layer 'norm' "
                 "(torch::nn::BatchNorm1d) cannot be synchronized"));
  CHECK(contains(run->result.output, "fulgur::nn::BatchNorm"));
  // The same model without the key trains with local statistics, as torch::nn::BatchNorm1d does.
  auto unsynced = run_worker(worker_config("ddp", "2", 8, 2), {}, env);
  REQUIRE_SUCCESS(unsynced);
}

TEST_CASE("ddp: loaders of unknown length that end at different batches end every rank's epoch together") {
  // 96 samples, batch 8: 6 batches per rank, but rank 1's loader ends after 5 and neither knows its
  // length. The ranks agree on the end of each epoch: 5 steps per epoch on both, so the 12th step
  // falls in epoch 2 everywhere (which then counts as done: epoch 3), and the replicas stay
  // identical. Without the agreement rank 0 would take 6 steps per epoch (ending at epoch 2) and
  // wait in a gradient collective that rank 1 never joins.
  auto env = clean_env();
  env["FULGUR_TEST_UNKNOWN_LENGTH"] = "1";
  auto ddp = run_worker(worker_config("ddp", "2", 8, 12), {}, env);
  REQUIRE_SUCCESS(ddp);
  const auto m0 = metrics(*ddp, 0), m1 = metrics(*ddp, 1);
  CHECK(m0.at("global_step") == 12);
  CHECK(m1.at("global_step") == 12);
  CHECK(m0.at("current_epoch") == 3);
  CHECK(m1.at("current_epoch") == 3);
  CHECK(max_difference(weights(*ddp, 0), weights(*ddp, 1)) == 0.0);
}

TEST_CASE("ddp: gradient accumulation syncs once per window and matches one process") {
  auto single = run_worker(worker_config("single_device", "1", 8, 4, /*accumulate=*/2));
  REQUIRE_SUCCESS(single);
  auto ddp = run_worker(worker_config("ddp", "2", 4, 4, /*accumulate=*/2));
  REQUIRE_SUCCESS(ddp);
  CHECK(max_difference(weights(*ddp, 0), weights(*ddp, 1)) == 0.0);
  CHECK(max_difference(weights(*ddp, 0), weights(*single, 0)) < 1e-5);
}

TEST_CASE("ddp under 16-mixed: an inf on one rank skips that step on every rank, decided on the device") {
  // Rank 1's 3rd loss is infinite: after the gradient all-reduce both ranks hold non-finite
  // gradients, and both fused AdamW steps skip on the device flag; the scale halves once.
  auto env = clean_env();
  env["FULGUR_TEST_OPTIMIZER"] = "adamw";
  env["FULGUR_TEST_INF_RANK"] = "1";
  env["FULGUR_TEST_INF_STEP"] = "3";
  env["FULGUR_LOG_LEVEL"] = "debug";
  std::string config = worker_config("ddp", "2", 8, 6);
  config.insert(config.find("logger = false"), "precision = \"16-mixed\"\n");
  auto ddp = run_worker(config, {}, env);
  REQUIRE_SUCCESS(ddp);
  CHECK(contains(ddp->result.output, "optimizer steps are decided on the device"));
  CHECK(max_difference(weights(*ddp, 0), weights(*ddp, 1)) == 0.0);  // the same decision on both
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    const auto m = metrics(*ddp, rank);
    CHECK(m.at("global_step") == 6);
    CHECK(m.at("optimizer_step_count") == 5);  // 6 batches, 1 skipped
    CHECK(m.at("loss_scale") == 32768.0);      // 65536 halved once
  }
  // Without the inf: every step taken, the scale untouched.
  env.erase("FULGUR_TEST_INF_RANK");
  auto clean = run_worker(config, {}, env);
  REQUIRE_SUCCESS(clean);
  CHECK(metrics(*clean, 1).at("optimizer_step_count") == 6);
  CHECK(metrics(*clean, 1).at("loss_scale") == 65536.0);
  CHECK(max_difference(weights(*clean, 0), weights(*ddp, 0)) > 0.0);
}

TEST_CASE("ddp: parameters without gradients need find_unused_parameters") {
  auto env = clean_env();
  env["FULGUR_TEST_UNUSED_LAYER"] = "1";
  std::string toml = worker_config("ddp", "2", 8, 4);
  auto refused = run_worker(toml, {}, env);
  CHECK(refused->result.status != 0);
  CHECK_FALSE(refused->result.timed_out);
  CHECK(contains(refused->result.output, "parameters unused.weight, unused.bias got no gradient"));
  CHECK(contains(refused->result.output, "find_unused_parameters = true"));
  toml = with_strategy_option(toml, "find_unused_parameters = true");
  auto run = run_worker(toml, {}, env);
  REQUIRE_SUCCESS(run);
  CHECK(max_difference(weights(*run, 0), weights(*run, 1)) == 0.0);
  CHECK(metrics(*run, 0).at("global_step") == 4);
  // With gradient accumulation the Reducer fails elsewhere (the next micro-step's backward), in
  // Python's terms; the message is still ours, with the fix.
  auto accumulating = run_worker(worker_config("ddp", "2", 8, 4, 2), {}, env);
  CHECK(accumulating->result.status != 0);
  CHECK(contains(accumulating->result.output, "some parameters got no gradient in a synchronised step"));
  CHECK(contains(accumulating->result.output, "find_unused_parameters = true"));
  CHECK_FALSE(contains(accumulating->result.output, "marked as ready twice"));
}

TEST_CASE("ddp: bucket_cap_mb is validated, and another bucket size reaches the same weights") {
  std::string toml = worker_config("ddp", "2", 8, 4);
  auto refused = run_worker(with_strategy_option(toml, "bucket_cap_mb = 0"));
  CHECK(refused->result.status != 0);
  CHECK_FALSE(refused->result.timed_out);
  CHECK(contains(refused->result.output, "strategy 'ddp': bucket_cap_mb must be at least 1"));
  // The buckets decide only when each all-reduce starts (bench/distributed.sh --overlap measures
  // how much of it backward hides), not what it sums: the default and 1 MiB train alike.
  auto default_size = run_worker(toml);
  REQUIRE_SUCCESS(default_size);
  auto small = run_worker(with_strategy_option(toml, "bucket_cap_mb = 1"));
  REQUIRE_SUCCESS(small);
  CHECK(max_difference(weights(*small, 0), weights(*small, 1)) == 0.0);
  CHECK(max_difference(weights(*small, 0), weights(*default_size, 0)) == 0.0);
}

TEST_CASE("ddp: an early-stopping decision made on one rank stops every rank together") {
  // Rank 1 sees val/own_rank = 1 (past the threshold: stop), rank 0 sees 0 (go on). Unless the
  // decision is agreed, rank 0 would train on alone and wait forever in its next all-reduce.
  const std::string early_stopping = R"(
[[callbacks]]
name = "early_stopping"
monitor = "val/own_rank"
mode = "max"
stopping_threshold = 0.5
)";
  auto run = run_worker(worker_config("ddp", "2", 8, 100) + early_stopping);
  REQUIRE_SUCCESS(run);
  CHECK(metrics(*run, 0).at("global_step") == 6);  // one epoch: 96 samples / 2 ranks / batch 8
  CHECK(metrics(*run, 1).at("global_step") == 6);
}

TEST_CASE("ddp: the same binary runs under torchrun") {
  auto launcher = run_worker(worker_config("ddp", "2", 8, 4, 1, /*shuffle=*/true));
  REQUIRE_SUCCESS(launcher);
  auto torchrun = run_worker(worker_config("ddp", "auto", 8, 4, 1, /*shuffle=*/true), {}, clean_env(), true);
  REQUIRE_SUCCESS(torchrun);
  CHECK_FALSE(contains(torchrun->result.output, "Fulgur launcher"));
  CHECK(max_difference(weights(*torchrun, 0), weights(*torchrun, 1)) == 0.0);
  CHECK(max_difference(weights(*torchrun, 0), weights(*launcher, 0)) == 0.0);
}

TEST_CASE("ddp: a resumed run continues exactly") {
  // 96 samples, 2 ranks, batch 8: 6 steps per epoch. The checkpoint at step 4 is mid-epoch,
  // written by rank 0 (model_checkpoint) while both ranks train with a shuffled sampler.
  auto whole = run_worker(worker_config("ddp", "2", 8, 10, 1, true));
  REQUIRE_SUCCESS(whole);
  auto first = run_worker(worker_config("ddp", "2", 8, 5, 1, true) + kCheckpointEvery4Steps);
  REQUIRE_SUCCESS(first);
  const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
  auto resumed = run_worker(worker_config("ddp", "2", 8, 10, 1, true), {"--resume", ckpt.string()});
  REQUIRE_SUCCESS(resumed);
  CHECK(contains(resumed->result.output, "global step 4"));
  CHECK(metrics(*resumed, 0).at("global_step") == 10);
  CHECK(max_difference(weights(*resumed, 0), weights(*whole, 0)) == 0.0);
  CHECK(max_difference(weights(*resumed, 1), weights(*whole, 1)) == 0.0);
}

// ---- fsdp (ZeRO-1/2) --------------------------------------------------------------------------

namespace {
// AdamW with weight decay on a model with uneven first dimensions (32 and 4 rows over 2 and 3
// ranks: short and empty chunks), a 0-dim parameter, a frozen layer and an unused one.
std::map<std::string, std::string> sharding_env() {
  auto env = clean_env();
  env["FULGUR_TEST_SHARDING_MODEL"] = "1";
  env["FULGUR_TEST_UNUSED_LAYER"] = "1";
  env["FULGUR_TEST_OPTIMIZER"] = "adamw";
  return env;
}
}  // namespace

TEST_CASE("fsdp: ZeRO-1 and ZeRO-2 on 2 and 3 ranks reach the weights of one process") {
  // One process with batch 24 and accumulation 2 is the reference; N ranks read 24 / N each.
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, sharding_env());
  REQUIRE_SUCCESS(single);
  for (int stage : {1, 2})
    for (int ranks : {2, 3}) {
      CAPTURE(stage);
      CAPTURE(ranks);
      auto env = sharding_env();
      env["FULGUR_TEST_SCRAMBLE_INIT"] = "1";  // rank 0's initial weights must win
      auto run =
          run_worker(worker_config(fmt::format("fsdp:{}", stage), std::to_string(ranks), 24 / ranks, 6, 2), {}, env);
      REQUIRE_SUCCESS(run);
      for (int r = 1; r < ranks; ++r) CHECK(max_difference(weights(*run, 0), weights(*run, r)) == 0.0);
      CHECK(max_difference(weights(*run, 0), weights(*single, 0)) < 1e-5);
      CHECK(metrics(*run, 0).at("global_step") == 6);
    }
}

TEST_CASE("fsdp: a checkpoint of 2 ZeRO-2 ranks holds full state and resumes on 3 ranks and in one process") {
  auto whole = run_worker(worker_config("fsdp:2", "2", 12, 10), {}, sharding_env());
  REQUIRE_SUCCESS(whole);
  auto first = run_worker(worker_config("fsdp:2", "2", 12, 5) + kCheckpointEvery4Steps, {}, sharding_env());
  REQUIRE_SUCCESS(first);
  const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
  // Gathered on rank zero: Adam's moments have the parameters' full shapes.
  const c10::IValue file = fulgur::read_checkpoint_file(ckpt.string());
  const auto states = file.toGenericDict().at("optimizer_states").toList();
  REQUIRE(states.size() == 1);
  const auto per_parameter = states.get(0).toGenericDict().at("state").toGenericDict();
  std::set<std::vector<int64_t>> shapes;
  for (const auto& entry : per_parameter) {
    const at::Tensor moment = entry.value().toGenericDict().at("exp_avg").toTensor();
    shapes.insert(moment.sizes().vec());
  }
  CHECK(shapes.count({32, 16}) == 1);  // fc1.weight: 16 + 16 rows on the two ranks
  CHECK(shapes.count({4, 32}) == 1);   // fc2.weight: 2 + 2 rows
  CHECK(shapes.count({}) == 1);        // the 0-dim scale, owned by rank 0

  auto on_three = run_worker(worker_config("fsdp:2", "3", 8, 10), {"--resume", ckpt.string()}, sharding_env());
  REQUIRE_SUCCESS(on_three);
  CHECK(contains(on_three->result.output, "global step 4"));
  CHECK(max_difference(weights(*on_three, 0), weights(*whole, 0)) < 1e-5);
  auto alone = run_worker(worker_config("single_device", "1", 24, 10), {"--resume", ckpt.string()}, sharding_env());
  REQUIRE_SUCCESS(alone);
  CHECK(max_difference(weights(*alone, 0), weights(*whole, 0)) < 1e-5);
}

// ---- fsdp ZeRO-3 and blocks ------------------------------------------------------------------

namespace {
std::map<std::string, std::string> block_env(bool checkpoint_activations = false) {
  auto env = sharding_env();
  env["FULGUR_TEST_BLOCKS"] = "1";
  if (checkpoint_activations) env["FULGUR_TEST_CHECKPOINT"] = "1";
  return env;
}
}  // namespace

TEST_CASE("fsdp: ZeRO-3 on 2 and 3 ranks reaches the weights of one process and leaves block parameters freed") {
  // fc1 and fc2 are blocks (units); the 0-dim scale, the frozen and the unused layer stay outside.
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, sharding_env());
  REQUIRE_SUCCESS(single);
  struct Case {
    int ranks;
    bool reshard_after_forward;
  };
  for (const Case c : {Case{2, true}, Case{3, true}, Case{2, false}}) {
    CAPTURE(c.ranks);
    CAPTURE(c.reshard_after_forward);
    auto env = block_env();
    env["FULGUR_TEST_SCRAMBLE_INIT"] = "1";  // rank 0's initial weights must win
    std::string toml = worker_config("fsdp:3", std::to_string(c.ranks), 24 / c.ranks, 6, 2);
    if (!c.reshard_after_forward)
      toml.replace(toml.find("zero_stage = 3"), 14, "zero_stage = 3\nreshard_after_forward = false");
    auto run = run_worker(toml, {}, env);
    REQUIRE_SUCCESS(run);
    for (int r = 0; r < c.ranks; ++r) {
      CHECK(max_difference(weights(*run, r), weights(*single, 0)) < 1e-5);
      // After fit the blocks' parameters hold no storage; the weights above were gathered whole.
      CHECK(metrics(*run, r).at("fc1_weight_bytes") == 0);
    }
    CHECK(metrics(*run, 0).at("global_step") == 6);
  }
}

TEST_CASE(
    "fsdp: ZeRO-3 shards each block as configure_model builds it (fulgur::built_block), from rank 0's random "
    "state, and reaches the weights of one process") {
  auto env = block_env();
  env["FULGUR_TEST_BUILT_BLOCKS"] = "1";
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, env);
  REQUIRE_SUCCESS(single);
  // Ranks other than 0 are seeded differently before fit: the blocks they build would differ,
  // and are never whole on any rank afterwards to be overwritten; they must build from rank 0's state.
  env["FULGUR_TEST_SCRAMBLE_INIT"] = "1";
  env["FULGUR_LOG_LEVEL"] = "debug";
  for (const int ranks : {2, 3}) {
    CAPTURE(ranks);
    auto run = run_worker(worker_config("fsdp:3", std::to_string(ranks), 24 / ranks, 6, 2), {}, env);
    REQUIRE_SUCCESS(run);
    for (int r = 0; r < ranks; ++r) {
      CHECK(max_difference(weights(*run, r), weights(*single, 0)) < 1e-5);
      CHECK(metrics(*run, r).at("fc1_weight_bytes") == 0);
    }
    // fc1 (32x16 + 32) and fc2 (4x32 + 4) are 676 floats, 2704 bytes; fc1 (2176 bytes) is the
    // largest whole at once. Rank 0 keeps rows 0-15 of fc1 and 0-1 of fc2 on 2 ranks (16x17 + 2x33
    // floats), rows 0-10 and 0-1 on 3 (11x17 + 2x33).
    const std::string kept = ranks == 2 ? "1352" : "1012";
    CHECK(contains(run->result.output,
                   "rank 0 sharded 2 blocks as they were built: 2704 bytes of parameters, this "
                   "rank keeps " +
                       kept +
                       " bytes of them; the largest block was whole for a "
                       "moment: 2176 bytes"));
  }
  // Under ddp the same program builds whole layers and trains the same weights; both then run
  // validate in the same processes. Under ZeRO-3 the shards stay for it (the blocks are never whole
  // outside run_block) and it reports ddp's validation loss (over the same two halves of the data).
  env["FULGUR_TEST_VALIDATE_AFTER_FIT"] = "1";
  auto ddp =
      run_worker(with_strategy_option(worker_config("ddp", "2", 12, 6, 2), "find_unused_parameters = true"), {}, env);
  REQUIRE_SUCCESS(ddp);
  CHECK(max_difference(weights(*ddp, 1), weights(*single, 0)) < 1e-5);
  auto then_validate = run_worker(worker_config("fsdp:3", "2", 12, 6, 2), {}, env);
  REQUIRE_SUCCESS(then_validate);
  CHECK(contains(then_validate->result.output, "rank 0 keeps the shards of the previous stage"));
  for (int r = 0; r < 2; ++r) {
    CHECK(max_difference(weights(*then_validate, r), weights(*single, 0)) < 1e-5);
    CHECK(metrics(*then_validate, r).at("fc1_weight_bytes") == 0);
    CHECK(metrics(*then_validate, r).at("val/loss") == doctest::Approx(metrics(*ddp, r).at("val/loss")).epsilon(1e-6));
  }
}

TEST_CASE("fsdp: ZeRO-3 runs the collectives it is designed to, per step and per unit") {
  // Per optimizer step on 2 ranks, no accumulation. Forward: one all-gather per block (fc1, fc2),
  // none on the first step (the parameters start whole). Backward: a hook on each block's output
  // gathers it again (2); fc2's input needs a gradient, so fc2 reduce-scatters as soon as its
  // backward is done (1); fc1 (input: data) and the parameters outside blocks reduce-scatter at the
  // end of backward (1). After the step the parameters outside blocks are gathered (1).
  // Prefetching starts some of these ahead, one unit at a time, without adding any: in backward,
  // fc1's while fc2 computes (from step 1); in forward, fc2's while fc1 computes (from step 2, which
  // follows the order step 1 ran).
  auto env = block_env();
  env["FULGUR_LOG_LEVEL"] = "debug";
  auto run = run_worker(worker_config("fsdp:3", "2", 12, 3), {}, env);
  REQUIRE_SUCCESS(run);
  const std::string& out = run->result.output;
  const std::string line = "since the previous optimizer step: ";
  CHECK(contains(out, line + "3 all-gathers (1 started ahead), 2 reduce-scatters (2 units)"));
  CHECK(contains(out, line + "5 all-gathers (2 started ahead), 2 reduce-scatters (2 units)"));
  CHECK_FALSE(contains(out, "3 reduce-scatters"));
  // Without prefetching: the same collectives, none started ahead.
  std::string toml = worker_config("fsdp:3", "2", 12, 3);
  toml.replace(toml.find("zero_stage = 3"), 14, "zero_stage = 3\nprefetch = false");
  auto plain = run_worker(toml, {}, env);
  REQUIRE_SUCCESS(plain);
  CHECK(contains(plain->result.output, line + "5 all-gathers (0 started ahead), 2 reduce-scatters (2 units)"));
  // With reshard_after_forward = false a block stays whole from its forward to its backward:
  // backward gathers nothing (step 1: only the parameters outside blocks after the step; then
  // fc1, fc2 started ahead, and those).
  toml = worker_config("fsdp:3", "2", 12, 3);
  toml.replace(toml.find("zero_stage = 3"), 14, "zero_stage = 3\nreshard_after_forward = false");
  auto kept = run_worker(toml, {}, env);
  REQUIRE_SUCCESS(kept);
  CHECK(contains(kept->result.output, line + "1 all-gathers (0 started ahead), 2 reduce-scatters (2 units)"));
  CHECK(contains(kept->result.output, line + "3 all-gathers (1 started ahead), 2 reduce-scatters (2 units)"));
  CHECK_FALSE(contains(kept->result.output, "5 all-gathers"));
}

// ---- fsdp overlap_reduce: gradients averaged while backward runs --------------------------------

namespace {
// The bucket counts of the debug line "N of M gradient buckets started during backward", per line.
std::vector<std::pair<int, int>> buckets_started(const std::string& output) {
  std::vector<std::pair<int, int>> found;
  const std::regex line(R"((\d+) of (\d+) gradient buckets started during backward)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it)
    found.emplace_back(std::stoi((*it)[1]), std::stoi((*it)[2]));
  return found;
}
}  // namespace

TEST_CASE("fsdp overlap_reduce: ZeRO-1, 2 and 3 reach bitwise the weights of the blocking path on 2 ranks") {
  // The sharding model (uneven rows, a 0-dim parameter, a frozen and an unused layer), accumulation
  // 2 (micro-steps reduce nothing), buckets of about 200 bytes (one or two parameters each): every
  // element is reduced by the same sum and division as after backward, and a + b = b + a, so the
  // weights are equal bit for bit. On 3 ranks Gloo may add an element's three values in another
  // order: float rounding, no more.
  for (int stage : {1, 2, 3})
    for (int ranks : {2, 3}) {
      if (ranks == 3 && stage != 2) continue;
      CAPTURE(stage);
      CAPTURE(ranks);
      auto env = stage == 3 ? block_env() : sharding_env();
      env["FULGUR_LOG_LEVEL"] = "debug";
      const std::string base = worker_config(fmt::format("fsdp:{}", stage), std::to_string(ranks), 24 / ranks, 6, 2);
      auto blocking = run_worker(with_strategy_option(base, "overlap_reduce = false"), {}, env);
      REQUIRE_SUCCESS(blocking);
      auto overlapped =
          run_worker(stage == 3 ? base : with_strategy_option(base, "reduce_bucket_mb = 0.0002"), {}, env);
      REQUIRE_SUCCESS(overlapped);
      for (int r = 0; r < ranks; ++r) {
        if (ranks == 2)
          CHECK(max_difference(weights(*overlapped, r), weights(*blocking, r)) == 0.0);
        else
          CHECK(max_difference(weights(*overlapped, r), weights(*blocking, r)) < 1e-6);
      }
      CHECK(metrics(*overlapped, 0).at("global_step") == 6);
      CHECK(buckets_started(blocking->result.output).empty());
      if (stage == 3) {
        // fc2's reduce-scatter starts in backward and overlaps fc1's; fc1 (input: data) and the
        // parameters outside blocks are reduced at the end.
        CHECK(contains(overlapped->result.output, "2 reduce-scatters (2 units), 1 of the reduce-scatters overlapping"));
        CHECK(contains(blocking->result.output, "2 reduce-scatters (2 units), 0 of the reduce-scatters overlapping"));
        continue;
      }
      // Buckets of about 200 bytes: fc1.weight, fc1.bias and fc2.weight each alone, the rest together.
      const auto counts = buckets_started(overlapped->result.output);
      REQUIRE(!counts.empty());
      CHECK(counts.size() % 6 == 0);  // per rank, one per optimizer step (accumulation 2: 12 backward passes)
      CHECK(counts.front().second >= 4);
    }
}

TEST_CASE("fsdp overlap_reduce: buckets start in backward as their gradients are ready, in order on every rank") {
  // Without the unused layer every parameter's gradient arrives during backward: every bucket starts
  // before backward ends. With it (its bucket comes early in backward's order and never fills), the
  // buckets after it wait for the end of backward, so that the collectives still pair up: the
  // weights stay those of one process.
  auto env = sharding_env();
  env.erase("FULGUR_TEST_UNUSED_LAYER");
  env["FULGUR_LOG_LEVEL"] = "debug";
  const std::string toml = with_strategy_option(worker_config("fsdp:2", "2", 12, 3), "reduce_bucket_mb = 0.0002");
  auto all_used = run_worker(toml, {}, env);
  REQUIRE_SUCCESS(all_used);
  REQUIRE(!buckets_started(all_used->result.output).empty());
  for (const auto& [started, buckets] : buckets_started(all_used->result.output)) {
    CHECK(buckets >= 4);
    CHECK(started == buckets);
  }
  env["FULGUR_TEST_UNUSED_LAYER"] = "1";
  auto one_unused = run_worker(toml, {}, env);
  REQUIRE_SUCCESS(one_unused);
  const auto counts = buckets_started(one_unused->result.output);
  REQUIRE(!counts.empty());
  CHECK(counts.size() % 3 == 0);  // per rank, one per step
  for (const auto& [started, buckets] : counts) CHECK(started < buckets);
  auto single = run_worker(worker_config("single_device", "1", 24, 3), {}, sharding_env());
  REQUIRE_SUCCESS(single);
  CHECK(max_difference(weights(*one_unused, 0), weights(*single, 0)) < 1e-5);
}

TEST_CASE("fsdp overlap_reduce: a ZeRO-2 run with gradient buckets resumed mid-epoch continues exactly") {
  auto config = [](int64_t steps) {
    return with_strategy_option(worker_config("fsdp:2", "2", 8, steps, 1, true), "reduce_bucket_mb = 0.0002");
  };
  auto whole = run_worker(config(10), {}, sharding_env());
  REQUIRE_SUCCESS(whole);
  auto first = run_worker(config(5) + kCheckpointEvery4Steps, {}, sharding_env());
  REQUIRE_SUCCESS(first);
  const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
  auto resumed = run_worker(config(10), {"--resume", ckpt.string()}, sharding_env());
  REQUIRE_SUCCESS(resumed);
  CHECK(contains(resumed->result.output, "global step 4"));
  CHECK(metrics(*resumed, 0).at("global_step") == 10);
  CHECK(max_difference(weights(*resumed, 0), weights(*whole, 0)) == 0.0);
  CHECK(max_difference(weights(*resumed, 1), weights(*whole, 1)) == 0.0);
}

TEST_CASE("fsdp: a ZeRO-3 checkpoint holds whole tensors and resumes on 3 ranks and in one process") {
  auto whole = run_worker(worker_config("fsdp:3", "2", 12, 10), {}, block_env());
  REQUIRE_SUCCESS(whole);
  auto first = run_worker(worker_config("fsdp:3", "2", 12, 5) + kCheckpointEvery4Steps, {}, block_env());
  REQUIRE_SUCCESS(first);
  const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
  const c10::IValue file = fulgur::read_checkpoint_file(ckpt.string());
  const auto model = file.toGenericDict().at("state_dict").toGenericDict();
  CHECK(model.at("fc1.weight").toTensor().sizes().vec() == std::vector<int64_t>{32, 16});
  CHECK(model.at("fc1.weight").toTensor().abs().sum().item<double>() > 0);

  auto on_three = run_worker(worker_config("fsdp:3", "3", 8, 10), {"--resume", ckpt.string()}, block_env());
  REQUIRE_SUCCESS(on_three);
  CHECK(contains(on_three->result.output, "global step 4"));
  CHECK(max_difference(weights(*on_three, 0), weights(*whole, 0)) < 1e-5);
  auto alone = run_worker(worker_config("single_device", "1", 24, 10), {"--resume", ckpt.string()}, block_env());
  REQUIRE_SUCCESS(alone);
  CHECK(max_difference(weights(*alone, 0), weights(*whole, 0)) < 1e-5);
}

TEST_CASE("fsdp: a ZeRO-3 run resumed mid-epoch on the same ranks continues exactly") {
  // Shuffled, 2 ranks, batch 8: 6 steps per epoch; the checkpoint at step 4 is mid-epoch.
  auto whole = run_worker(worker_config("fsdp:3", "2", 8, 10, 1, true), {}, block_env());
  REQUIRE_SUCCESS(whole);
  auto first = run_worker(worker_config("fsdp:3", "2", 8, 5, 1, true) + kCheckpointEvery4Steps, {}, block_env());
  REQUIRE_SUCCESS(first);
  const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
  auto resumed = run_worker(worker_config("fsdp:3", "2", 8, 10, 1, true), {"--resume", ckpt.string()}, block_env());
  REQUIRE_SUCCESS(resumed);
  CHECK(contains(resumed->result.output, "global step 4"));
  CHECK(metrics(*resumed, 0).at("global_step") == 10);
  CHECK(max_difference(weights(*resumed, 0), weights(*whole, 0)) == 0.0);
  CHECK(max_difference(weights(*resumed, 1), weights(*whole, 1)) == 0.0);
}

TEST_CASE("fsdp: sharded checkpoints, each rank writing its rows, resume on 2 and 3 ranks and in one process") {
  auto sharded = [](const std::string& toml) { return with_strategy_option(toml, "state_dict_type = \"sharded\""); };
  for (const std::string stage : {"fsdp:2", "fsdp:3"}) {
    CAPTURE(stage);
    auto whole = run_worker(worker_config(stage, "2", 12, 10), {}, block_env());
    REQUIRE_SUCCESS(whole);
    auto first = run_worker(sharded(worker_config(stage, "2", 12, 5)) + kCheckpointEvery4Steps, {}, block_env());
    REQUIRE_SUCCESS(first);
    // A directory in torch.distributed.checkpoint's layout: one data file per rank, the metadata.
    const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
    REQUIRE_MESSAGE(fs::is_directory(ckpt), first->result.output);
    CHECK(fs::exists(ckpt / ".metadata"));
    CHECK(fs::exists(ckpt / "__0_0.distcp"));
    CHECK(fs::exists(ckpt / "__1_0.distcp"));
    // The same full checkpoint, gathered, for comparison.
    auto full = run_worker(worker_config(stage, "2", 12, 5) + kCheckpointEvery4Steps, {}, block_env());
    REQUIRE_SUCCESS(full);
    const c10::IValue gathered = fulgur::read_checkpoint_file((full->dir / "ckpts" / "step=4.ckpt").string());

    // Python's own tool consolidates it; every tensor equals the gathered checkpoint's.
    const fs::path consolidated = first->dir / "consolidated.pt";
    auto python = run_process({FULGUR_TEST_PYTHON, "-c",
                               "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                               "dcp_to_torch_save(sys.argv[1], sys.argv[2])",
                               ckpt.string(), consolidated.string()},
                              clean_env(), first->dir / "python.log");
    REQUIRE_MESSAGE(python.status == 0, python.output);
    const c10::IValue from_python = fulgur::read_checkpoint_file(consolidated.string());
    const auto expected = gathered.toGenericDict().at("state_dict").toGenericDict();
    const auto actual = from_python.toGenericDict().at("state_dict").toGenericDict();
    CHECK(actual.size() == expected.size());
    for (const auto& entry : expected)
      CHECK_MESSAGE(torch::equal(actual.at(entry.key()).toTensor(), entry.value().toTensor()),
                    entry.key().toStringRef());
    const auto moments = from_python.toGenericDict().at("optimizer_states").toList();
    CHECK(moments.size() == 1);
    // A PyTorch FSDP2 run of the same model on 2 Gloo ranks loads it into its DTensor shards.
    auto fsdp2 = run_process({FULGUR_TEST_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              FULGUR_TEST_SOURCE_DIR "/tests/python/fsdp2_load.py", ckpt.string(),
                              (full->dir / "ckpts" / "step=4.ckpt").string()},
                             clean_env(), first->dir / "fsdp2.log");
    CHECK_MESSAGE(fsdp2.status == 0, fsdp2.output);
    CHECK(contains(fsdp2.output, "fsdp2-load-ok"));

    auto debug_env = block_env();
    debug_env["FULGUR_LOG_LEVEL"] = "debug";
    auto on_two = run_worker(sharded(worker_config(stage, "2", 12, 10)), {"--resume", ckpt.string()}, debug_env);
    REQUIRE_SUCCESS(on_two);
    CHECK(contains(on_two->result.output, "global step 4"));
    if (stage == "fsdp:3") {
      // Under ZeRO-3 each rank reads only its rows of the parameters and their moments: the two
      // ranks' reads partition the checkpoint's bytes, neither reads them all.
      const std::string& log = on_two->result.output;
      int64_t ranks = 0, read_by_all = 0, total = 0;
      for (size_t at = log.find("read its rows of"); at != std::string::npos;
           at = log.find("read its rows of", at + 1)) {
        int64_t tensors = 0, read = 0;
        REQUIRE(std::sscanf(log.c_str() + at, "read its rows of %ld tensors from %*s %ld of %ld bytes", &tensors, &read,
                            &total) == 3);
        CHECK(tensors > 0);
        CHECK(read < total);
        read_by_all += read;
        ++ranks;
      }
      CHECK_MESSAGE(ranks == 2, log);
      CHECK(read_by_all == total);
    }
    CHECK(max_difference(weights(*on_two, 0), weights(*whole, 0)) == 0.0);
    auto on_three = run_worker(worker_config(stage, "3", 8, 10), {"--resume", ckpt.string()}, block_env());
    REQUIRE_SUCCESS(on_three);
    CHECK(max_difference(weights(*on_three, 0), weights(*whole, 0)) < 1e-5);
    auto alone = run_worker(worker_config("single_device", "1", 24, 10), {"--resume", ckpt.string()}, block_env());
    REQUIRE_SUCCESS(alone);
    CHECK(max_difference(weights(*alone, 0), weights(*whole, 0)) < 1e-5);
  }
}

// ---- fsdp with fulgur::optim's Lion and Muon (#37) ---------------------------------------------

namespace {
// The blocks model of the ZeRO-3 tests (fc1 32x16, fc2 4x32: a short and, on 3 ranks, an empty
// chunk) stepped by `optimizer`: Lion on every parameter, or Muon on the two weights and its AdamW
// on the biases and the 0-dim scale. Without the unused layer: with it (it changes the frozen
// layer's initial weights) a 1-ulp difference of the averaged gradient, which any 2-rank run has
// (ddp too), flips one bfloat16 rounding of Newton-Schulz's input at step 3 and ddp and fsdp alike
// end 3.3e-4 from one process; the gather itself is checked against ddp, bit for bit.
std::map<std::string, std::string> optim_env(const std::string& optimizer) {
  auto env = block_env();
  env.erase("FULGUR_TEST_UNUSED_LAYER");
  env["FULGUR_TEST_OPTIMIZER"] = optimizer;
  return env;
}
}  // namespace

TEST_CASE("#37 fsdp: Lion and Muon under ZeRO-1, 2 and 3 on 2 ranks reach the weights of one process") {
  for (const std::string optimizer : {"lion", "muon"}) {
    CAPTURE(optimizer);
    auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, optim_env(optimizer));
    REQUIRE_SUCCESS(single);
    // ddp steps whole tensors with the same averaged gradients: sharding must not change a bit.
    auto ddp = run_worker(worker_config("ddp", "2", 12, 6, 2), {}, optim_env(optimizer));
    REQUIRE_SUCCESS(ddp);
    for (int stage : {1, 2, 3}) {
      CAPTURE(stage);
      auto env = optim_env(optimizer);
      env["FULGUR_TEST_SCRAMBLE_INIT"] = "1";  // rank 0's initial weights must win
      env["FULGUR_LOG_LEVEL"] = "debug";
      auto run = run_worker(worker_config(fmt::format("fsdp:{}", stage), "2", 12, 6, 2), {}, env);
      REQUIRE_SUCCESS(run);
      CHECK(max_difference(weights(*run, 0), weights(*run, 1)) == 0.0);
      CHECK(max_difference(weights(*run, 0), weights(*ddp, 0)) == 0.0);
      CHECK(max_difference(weights(*run, 0), weights(*single, 0)) < 1e-5);
      CHECK(metrics(*run, 0).at("global_step") == 6);
      if (optimizer == "muon") {
        // Gathered per matrix, in bfloat16: per step each rank sends its padded rows of fc1.weight
        // (16 x 16) and fc2.weight (2 x 32), 2 * (256 + 64) = 640 bytes, and receives the other
        // rank's 640 (formula: 2 * ceil(R / N) * C bytes out and (N - 1) times that in per matrix).
        for (int rank : {0, 1})
          CHECK_MESSAGE(contains(run->result.output,
                                 fmt::format("rank {} gathered 2 Muon matrices for Newton-Schulz in this step: sent "
                                             "640 bytes, received 640 bytes (bfloat16 rows)",
                                             rank)),
                        run->result.output);
      } else {
        CHECK_FALSE(contains(run->result.output, "Muon matrices"));
      }
    }
  }
}

TEST_CASE("#37 fsdp: Lion and Muon ZeRO-1/2/3 checkpoints resume bitwise, and on 3 ranks and in one process") {
  for (const std::string optimizer : {"lion", "muon"})
    for (int stage : {1, 2, 3}) {
      CAPTURE(optimizer);
      CAPTURE(stage);
      const std::string strategy = fmt::format("fsdp:{}", stage);
      const auto env = optim_env(optimizer);
      auto whole = run_worker(worker_config(strategy, "2", 12, 10), {}, env);
      REQUIRE_SUCCESS(whole);
      auto first = run_worker(worker_config(strategy, "2", 12, 5) + kCheckpointEvery4Steps, {}, env);
      REQUIRE_SUCCESS(first);
      const fs::path ckpt = first->dir / "ckpts" / "step=4.ckpt";
      REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
      auto resumed = run_worker(worker_config(strategy, "2", 12, 10), {"--resume", ckpt.string()}, env);
      REQUIRE_SUCCESS(resumed);
      CHECK(contains(resumed->result.output, "global step 4"));
      CHECK(max_difference(weights(*resumed, 0), weights(*whole, 0)) == 0.0);
      CHECK(max_difference(weights(*resumed, 1), weights(*whole, 1)) == 0.0);
      // Resharded: 3 ranks (fc2's 4 rows: 2, 2 and none) and one process.
      auto on_three = run_worker(worker_config(strategy, "3", 8, 10), {"--resume", ckpt.string()}, env);
      REQUIRE_SUCCESS(on_three);
      CHECK(max_difference(weights(*on_three, 0), weights(*whole, 0)) < 1e-5);
      auto alone = run_worker(worker_config("single_device", "1", 24, 10), {"--resume", ckpt.string()}, env);
      REQUIRE_SUCCESS(alone);
      CHECK(max_difference(weights(*alone, 0), weights(*whole, 0)) < 1e-5);
    }
}

TEST_CASE("#37 fsdp: sharded checkpoints with Lion or Muon are refused, naming the state_dict_type to use") {
  for (const std::string optimizer : {"lion", "muon"}) {
    CAPTURE(optimizer);
    auto run = run_worker(with_strategy_option(worker_config("fsdp:2", "2", 12, 2), "state_dict_type = \"sharded\""),
                          {}, optim_env(optimizer));
    CHECK(run->result.status != 0);
    CHECK_MESSAGE(contains(run->result.output,
                           "fulgur::optim's Lion and Muon keep theirs in one archive, gathered "
                           "whole: use state_dict_type = \"full\""),
                  run->result.output);
  }
}

TEST_CASE("fsdp: a rank killed during a sharded save leaves the previous checkpoint whole and resumable") {
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("the SDK was built without the fault-injection seam (-DFULGUR_FAULT_INJECTION=OFF)");
    return;
  }
  auto sharded = [](const std::string& toml) { return with_strategy_option(toml, "state_dict_type = \"sharded\""); };
  auto whole = run_worker(worker_config("fsdp:3", "2", 12, 10), {}, block_env());
  REQUIRE_SUCCESS(whole);
  // Rank 1 dies (SIGKILL) in its second save, at step 8, once its data file is written and before
  // the metadata and the swap into place (the test-only seam FULGUR_FAULT_INJECT).
  auto env = block_env();
  env["FULGUR_FAULT_INJECT"] = "dcp_save:2:1";
  auto killed = run_worker(sharded(worker_config("fsdp:3", "2", 12, 10)) + kCheckpointEvery4Steps, {}, env);
  INFO(killed->result.output);
  CHECK(killed->result.status != 0);
  CHECK_FALSE(killed->result.timed_out);
  CHECK(contains(killed->result.output, "rank 1"));
  const fs::path previous = killed->dir / "ckpts" / "step=4.ckpt";
  REQUIRE(fs::exists(previous / ".metadata"));
  CHECK_FALSE(fs::exists(killed->dir / "ckpts" / "step=8.ckpt"));  // never a half-written checkpoint
  auto resumed =
      run_worker(sharded(worker_config("fsdp:3", "2", 12, 10)), {"--resume", previous.string()}, block_env());
  REQUIRE_SUCCESS(resumed);
  CHECK(contains(resumed->result.output, "global step 4"));
  CHECK(max_difference(weights(*resumed, 0), weights(*whole, 0)) == 0.0);
}

TEST_CASE("fsdp: gradients averaged in bfloat16 (reduce_dtype) land near the float32 run, and not on it") {
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, sharding_env());
  REQUIRE_SUCCESS(single);
  for (const std::string stage : {"fsdp:1", "fsdp:2", "fsdp:3"}) {
    CAPTURE(stage);
    std::string toml = worker_config(stage, "2", 12, 6, 2);
    toml = with_strategy_option(toml, "reduce_dtype = \"bfloat16\"");
    auto run = run_worker(toml, {}, block_env());
    REQUIRE_SUCCESS(run);
    CHECK(max_difference(weights(*run, 0), weights(*run, 1)) == 0.0);
    const double difference = max_difference(weights(*run, 0), weights(*single, 0));
    CHECK(difference > 1e-6);  // the rounding is real: the option is not ignored
    CHECK(difference < 5e-2);
  }
  std::string toml = worker_config("fsdp:2", "2", 12, 2);
  toml = with_strategy_option(toml, "reduce_dtype = \"int8\"");
  auto refused = run_worker(toml, {}, sharding_env());
  CHECK(refused->result.status != 0);
  CHECK(contains(refused->result.output, "reduce_dtype = \"int8\" is not known"));
}

TEST_CASE(
    "fsdp: blocks gathered in bfloat16 (param_dtype) train near the float32 run, keep float32 shards and checkpoints") {
  const std::string checkpointing = R"(
[[callbacks]]
name = "model_checkpoint"
dirpath = "ckpts"
filename = "{step}"
every_n_train_steps = 3
save_top_k = -1
)";
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, sharding_env());
  REQUIRE_SUCCESS(single);
  std::string toml = worker_config("fsdp:3", "2", 12, 6, 2);
  toml = with_strategy_option(toml, "param_dtype = \"bfloat16\"");
  auto env = block_env();
  env["FULGUR_LOG_LEVEL"] = "debug";
  auto run = run_worker(toml + checkpointing, {}, env);
  REQUIRE_SUCCESS(run);
  // Gathered in bfloat16: the all-gathers carry half the bytes (logged per collective).
  CHECK_MESSAGE(contains(run->result.output, "computes in BFloat16"), run->result.output);
  // The weights fulgur::FullParameters hands out are the float32 shards, the same on both ranks.
  const auto mine = weights(*run, 0);
  for (const at::Tensor& w : mine) CHECK(w.dtype() == at::kFloat);
  CHECK(max_difference(mine, weights(*run, 1)) == 0.0);
  const double difference = max_difference(mine, weights(*single, 0));
  CHECK(difference > 1e-6);  // bfloat16 forward and backward: the option is not ignored
  CHECK(difference < 5e-2);
  // The checkpoint holds float32 parameters: the master weights, not the bfloat16 copies.
  const c10::IValue checkpoint = fulgur::read_checkpoint_file((run->dir / "ckpts" / "step=3.ckpt").string());
  for (const auto& entry : checkpoint.toGenericDict().at("state_dict").toGenericDict())
    CHECK_MESSAGE(entry.value().toTensor().dtype() == at::kFloat, entry.key().toStringRef());
  // Resumed from it, the run ends where the uninterrupted one did.
  auto resumed = run_worker(toml, {"--resume", (run->dir / "ckpts" / "step=3.ckpt").string()}, block_env());
  REQUIRE_SUCCESS(resumed);
  CHECK(max_difference(weights(*resumed, 0), mine) == 0.0);
  // Blocks that recompute in backward (activation checkpointing) recompute in bfloat16 too.
  auto recomputed = run_worker(toml, {}, block_env(/*checkpoint_activations=*/true));
  REQUIRE_SUCCESS(recomputed);
  CHECK(max_difference(weights(*recomputed, 0), mine) == 0.0);

  std::string stage2 = worker_config("fsdp:2", "2", 12, 2);
  stage2 = with_strategy_option(stage2, "param_dtype = \"bfloat16\"");
  auto refused = run_worker(stage2, {}, sharding_env());
  CHECK(refused->result.status != 0);
  CHECK(contains(refused->result.output, "param_dtype = \"BFloat16\" applies to zero_stage = 3"));
}

TEST_CASE("fsdp: under bf16-true the shards are made from the converted parameters: ZeRO-3 trains like ZeRO-2") {
  // The precision's conversion runs before the strategy's setup; ZeRO-3 once kept float32 shards
  // of the parameters as they were before it and trained into NaN.
  auto bf16 = [](std::string toml) {
    toml.replace(toml.find("seed = 7"), 8, "seed = 7\nprecision = \"bf16-true\"");
    return toml;
  };
  auto single = run_worker(bf16(worker_config("single_device", "1", 24, 6)), {}, sharding_env());
  REQUIRE_SUCCESS(single);
  auto stage2 = run_worker(bf16(worker_config("fsdp:2", "2", 12, 6)), {}, block_env());
  REQUIRE_SUCCESS(stage2);
  auto stage3 = run_worker(bf16(worker_config("fsdp:3", "2", 12, 6)), {}, block_env());
  REQUIRE_SUCCESS(stage3);
  const auto weights3 = weights(*stage3, 0);
  for (const at::Tensor& w : weights3) {
    CHECK(w.dtype() == at::kBFloat16);
    CHECK(w.isfinite().all().item<bool>());
  }
  CHECK(std::isfinite(metrics(*stage3, 0).at("train/loss")));
  CHECK(max_difference(weights3, weights(*stage2, 0)) == 0.0);
  CHECK(max_difference(weights3, weights(*single, 0)) < 5e-2);
}

TEST_CASE("fsdp: offload_optimizer steps host copies of the rows: ZeRO-1, 2 and 3 train as without it, and resume") {
  // Gradients clipped by norm: the norm must be taken over the host copies' gradients.
  auto clipped = [](std::string toml) {
    toml.replace(toml.find("seed = 7"), 8, "seed = 7\ngradient_clip_val = 0.05");
    return toml;
  };
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    auto env = stage == 3 ? block_env() : sharding_env();
    env["FULGUR_LOG_LEVEL"] = "debug";
    const std::string toml = clipped(worker_config(fmt::format("fsdp:{}", stage), "2", 12, 8, 2));
    const std::string offloaded_toml = with_strategy_option(toml, "offload_optimizer = true");
    auto plain = run_worker(toml, {}, env);
    REQUIRE_SUCCESS(plain);
    auto offloaded = run_worker(offloaded_toml + kCheckpointEvery4Steps, {}, env);
    REQUIRE_SUCCESS(offloaded);
    CHECK(max_difference(weights(*offloaded, 0), weights(*plain, 0)) == 0.0);
    CHECK(max_difference(weights(*offloaded, 1), weights(*plain, 1)) == 0.0);
    CHECK_FALSE(contains(plain->result.output, "host memory"));
    CHECK(contains(offloaded->result.output, "offload_optimizer = true on cpu: the parameters already live in host"));
    // 717 parameters in the optimizer: 359 rows' worth on rank 0 (with the 0-dim scale), 358 on rank 1.
    CHECK(contains(offloaded->result.output, "rank 0 steps its rows in host memory (offload_optimizer): 1436 bytes"));
    CHECK(contains(offloaded->result.output, "rank 1 steps its rows in host memory (offload_optimizer): 1432 bytes"));

    // The checkpoint (optimizer state gathered from host memory) resumes with and without offload.
    const fs::path ckpt = offloaded->dir / "ckpts" / "step=4.ckpt";
    REQUIRE_MESSAGE(fs::exists(ckpt), offloaded->result.output);
    auto resumed = run_worker(offloaded_toml, {"--resume", ckpt.string()}, env);
    REQUIRE_SUCCESS(resumed);
    CHECK(contains(resumed->result.output, "global step 4"));
    CHECK(max_difference(weights(*resumed, 0), weights(*plain, 0)) == 0.0);
    auto resumed_plain = run_worker(toml, {"--resume", ckpt.string()}, env);
    REQUIRE_SUCCESS(resumed_plain);
    CHECK(max_difference(weights(*resumed_plain, 1), weights(*plain, 1)) == 0.0);
  }
}

TEST_CASE("fsdp: state_dict_type other than full or sharded is refused") {
  std::string toml = worker_config("fsdp:2", "2", 12, 2);
  toml = with_strategy_option(toml, "state_dict_type = \"local\"");
  auto run = run_worker(toml, {}, sharding_env());
  CHECK(run->result.status != 0);
  CHECK(contains(run->result.output, "state_dict_type = \"local\" is not known"));
}

TEST_CASE("fsdp: the Fashion-MNIST MLP under ZeRO-3 on 2 ranks is refused, naming its layers and the fix") {
  // The shipped example program: its MLP calls fc1 and fc2 itself (no fulgur::run_block).
  TempDir dir;
  const fs::path plugins = fulgur::test::job::plugin_dir(dir, {});
  auto run = [&](const std::string& strategy_options) {
    const fs::path toml = dir / "job.toml";
    fulgur::test::write_bytes(toml,
                              fulgur::test::job::toml(dir.path(), plugins, 1, 2, "strategy = \"fsdp\"\ndevices = 2\n",
                                                      "[strategy]\nzero_stage = 3\n" + strategy_options));
    return fulgur::test::job::run_example(toml, dir.path());
  };
  const auto none = run("");
  CHECK(none.exit_code != 0);
  CHECK(contains(none.output, "zero_stage = 3 would shard none of the model's 203530 parameters (4 tensors"));
  const auto size = run("auto_wrap_policy = \"size\"\nauto_wrap_min_params = 1000\n");
  CHECK(size.exit_code != 0);
  CHECK(contains(size.output, "selects 2 submodule(s) whose forward the model's own code calls: 'fc1' ("));
  CHECK(contains(size.output, "200960 parameters"));
}

// ---- fsdp ZeRO-3: units from the Module or from auto_wrap_policy, never none (#33 item 3) -------

TEST_CASE("fsdp: ZeRO-3 refuses a model none of whose parameters is in a unit, and says at info how much it shards") {
  // fc1 and fc2 called by the model's own code: nothing to gather around, nothing sharded. Once
  // this trained silently as ZeRO-2 ("0 units" in the debug log only).
  auto none = run_worker(worker_config("fsdp:3", "2", 12, 3), {}, sharding_env());
  CHECK(none->result.status != 0);
  CHECK(contains(none->result.output,
                 "zero_stage = 3 would shard none of the model's 717 parameters (9 tensors: fc1.bias, fc1.weight"));
  CHECK(contains(none->result.output, "auto_wrap_policy = \"root\""));
  CHECK(contains(none->result.output, "fulgur::run_block"));
  // A size policy selects fc1 and fc2, which no Sequential calls: refused, naming them.
  auto direct = run_worker(with_strategy_option(worker_config("fsdp:3", "2", 12, 3),
                                                "auto_wrap_policy = \"size\"\nauto_wrap_min_params = 100"),
                           {}, sharding_env());
  CHECK(direct->result.status != 0);
  CHECK(contains(direct->result.output, "selects 2 submodule(s) whose forward the model's own code calls: 'fc1' ("));
  CHECK(contains(direct->result.output, "'fc2' ("));
  // Whole parameters accepted explicitly (FSDP's root unit alone): trains, and says so.
  auto root = run_worker(with_strategy_option(worker_config("fsdp:3", "2", 12, 3), "auto_wrap_policy = \"root\""), {},
                         sharding_env());
  REQUIRE_SUCCESS(root);
  CHECK(contains(root->result.output, "zero_stage = 3 shards 0 of 717 parameters (0.0%) in 0 units"));
  // Blocks: fc1 (16x32 + 32) and fc2 (32x4 + 4) are units; the 0-dim scale and the frozen layer
  // (and the unused one) stay whole, and the line at the default level says which.
  auto blocks = run_worker(worker_config("fsdp:3", "2", 12, 3), {}, block_env());
  REQUIRE_SUCCESS(blocks);
  CHECK(contains(blocks->result.output,
                 "zero_stage = 3 shards 676 of 717 parameters (94.3%) in 2 units (0 auto-wrapped); 41 parameters in "
                 "5 tensors outside units"));
  // The policy belongs to stage 3.
  auto stage2 = run_worker(with_strategy_option(worker_config("fsdp:2", "2", 12, 3), "auto_wrap_policy = \"size\""), {},
                           sharding_env());
  CHECK(stage2->result.status != 0);
  CHECK(contains(stage2->result.output, "auto_wrap_policy = \"size\" applies to zero_stage = 3"));
}

TEST_CASE(
    "fsdp: auto_wrap_policy makes a Sequential's layers ZeRO-3 units, freed between uses, and reaches the weights "
    "of one process") {
  auto env = sharding_env();
  env.erase("FULGUR_TEST_SHARDING_MODEL");  // only the Sequential's two Linears hold parameters
  env.erase("FULGUR_TEST_UNUSED_LAYER");
  env["FULGUR_TEST_SEQUENTIAL"] = "1";
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, env);
  REQUIRE_SUCCESS(single);
  env["FULGUR_TEST_SCRAMBLE_INIT"] = "1";  // rank 0's initial weights must win
  env["FULGUR_LOG_LEVEL"] = "debug";
  const std::string size = "auto_wrap_policy = \"size\"\nauto_wrap_min_params = 100";
  const std::string modules = "auto_wrap_policy = \"modules\"\nauto_wrap_modules = [\"Linear\"]";
  for (const std::string& policy : {size, modules}) {
    CAPTURE(policy);
    auto run = run_worker(with_strategy_option(worker_config("fsdp:3", "2", 12, 6, 2), policy), {}, env);
    REQUIRE_SUCCESS(run);
    const std::string& out = run->result.output;
    CHECK(contains(out, "zero_stage = 3 shards 676 of 676 parameters (100.0%) in 2 units (2 auto-wrapped)"));
    CHECK(contains(out, "makes 2 unit(s): 'layers.0' (torch::nn::Linear"));
    // Each layer gathered for its forward and its backward, one reduce-scatter each.
    CHECK(contains(out, "reduce-scatters (2 units)"));
    for (int r = 0; r < 2; ++r) {
      CHECK(max_difference(weights(*run, r), weights(*single, 0)) < 1e-5);
      CHECK(metrics(*run, r).at("fc1_weight_bytes") == 0);  // freed outside its uses
    }
  }
  // A size too large for any layer selects nothing: refused, not silently ZeRO-2.
  auto nothing =
      run_worker(with_strategy_option(worker_config("fsdp:3", "2", 12, 3), "auto_wrap_policy = \"size\""), {}, env);
  CHECK(nothing->result.status != 0);
  CHECK(contains(nothing->result.output, "(auto_wrap_min_params = 100000000) selects no submodule of the model"));
}

TEST_CASE("activation checkpointing: blocks that recompute reach the same weights under one process, ddp and ZeRO-3") {
  auto plain = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, block_env());
  REQUIRE_SUCCESS(plain);
  auto single = run_worker(worker_config("single_device", "1", 24, 6, 2), {}, block_env(true));
  REQUIRE_SUCCESS(single);
  CHECK(max_difference(weights(*single, 0), weights(*plain, 0)) < 1e-6);
  for (const std::string strategy : {"ddp", "fsdp:3"}) {
    CAPTURE(strategy);
    std::string toml = worker_config(strategy, "2", 12, 6, 2);
    if (strategy == "ddp")  // the model's unused layer
      toml = with_strategy_option(toml, "find_unused_parameters = true");
    auto run = run_worker(toml, {}, block_env(true));
    REQUIRE_SUCCESS(run);
    CHECK(max_difference(weights(*run, 0), weights(*plain, 0)) < 1e-5);
    CHECK(max_difference(weights(*run, 1), weights(*plain, 0)) < 1e-5);
  }
}

TEST_CASE("ddp: a killed rank ends the run with its rank named, without hanging") {
  auto env = clean_env();
  env["FULGUR_TEST_DIE_RANK"] = "1";
  env["FULGUR_TEST_DIE_STEP"] = "2";
  auto run = run_worker(worker_config("ddp", "2", 8, 50), {}, env);
  INFO(run->result.output);
  CHECK_FALSE(run->result.timed_out);
  CHECK(run->result.status != 0);
  CHECK(contains(run->result.output, "rank 1"));
  CHECK(contains(run->result.output, "killed by signal 9"));
  CHECK_FALSE(fs::exists(run->dir / "weights_rank0.pt"));
}

TEST_CASE("ddp: SIGTERM to the launching process ends every rank, with a checkpoint and status 143") {
  TempDir dir;
  const fs::path config = dir / "run.toml";
  std::string toml = worker_config("ddp", "2", 8, 1000000);
  toml.replace(toml.find("max_epochs = 100"), 16, "max_epochs = 1000000");
  fulgur::test::write_bytes(config, toml);
  const fs::path log = dir / "output.log";
  fulgur::test::write_bytes(log, "");
  auto env = clean_env();
  // Orphaned ranks become our children, so that they can be reaped and counted below.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  const pid_t pid = spawn({FULGUR_TEST_DDP_WORKER, config.string(), dir.path().string()}, env, log);
  // Wait until both ranks train (the collective check at fit start has passed).
  const auto start = std::chrono::steady_clock::now();
  while (!contains(fulgur::test::read_bytes(log), "started 2 processes") &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::seconds(2));
  REQUIRE(kill(pid, SIGTERM) == 0);  // the parent only, as a job scheduler would
  int status = 0;
  bool exited = false;
  for (int i = 0; i < 600 && !exited; ++i) {
    exited = waitpid(pid, &status, WNOHANG) == pid;
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!exited) kill(-pid, SIGKILL);
  REQUIRE(exited);
  // The signal stops fit at the next step on both ranks (rank 1 learns it from the agreement after
  // that step), they write interrupted.ckpt together and exit 128 + 15 (signal_connector.h).
  INFO(fulgur::test::read_bytes(log));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 143);
  CHECK(fs::exists(dir / "interrupted.ckpt"));  // default_root_dir "." is the TOML's directory
  // Nothing of the job is left in its process group.
  bool group_gone = false;
  for (int i = 0; i < 200 && !group_gone; ++i) {
    while (waitpid(-pid, nullptr, WNOHANG) > 0) {
    }
    group_gone = kill(-pid, 0) != 0 && errno == ESRCH;
    if (!group_gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!group_gone) kill(-pid, SIGKILL);
  CHECK(group_gone);
}

TEST_CASE("ddp: a rendezvous port already in use is a clear error") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(listen(fd, 1) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  auto env = clean_env();
  env["MASTER_PORT"] = std::to_string(ntohs(addr.sin_port));
  auto run = run_worker(worker_config("ddp", "2", 8, 4), {}, env);
  close(fd);
  INFO(run->result.output);
  CHECK_FALSE(run->result.timed_out);
  CHECK(run->result.status != 0);
  CHECK(contains(run->result.output, "already in use"));
  CHECK(contains(run->result.output, "MASTER_PORT"));
}

TEST_CASE("ddp: single_device under a multi-process launcher is refused") {
  auto run = run_worker(worker_config("single_device", "auto", 8, 2), {}, clean_env(), /*torchrun=*/true);
  CHECK(run->result.status != 0);
  CHECK(contains(run->result.output, "use a strategy that launches one process per device"));
}

// ---- in-process pieces ---------------------------------------------------------------------------

namespace {
fulgur::EnvironmentLookup lookup(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}
}  // namespace

TEST_CASE("cluster environment: none set is a single process") {
  auto c = fulgur::detect_cluster_environment(lookup({}));
  CHECK(c.kind == fulgur::ClusterKind::single_process);
  CHECK(c.info.world_size == 1);
  CHECK(c.info.global_rank == 0);
}

TEST_CASE("cluster environment: torchrun and Fulgur's launcher") {
  std::map<std::string, std::string> vars{
      {"RANK", "5"},       {"WORLD_SIZE", "8"},      {"LOCAL_RANK", "1"},     {"LOCAL_WORLD_SIZE", "4"},
      {"GROUP_RANK", "1"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"}};
  auto c = fulgur::detect_cluster_environment(lookup(vars));
  CHECK(c.kind == fulgur::ClusterKind::torchrun);
  CHECK(c.info.global_rank == 5);
  CHECK(c.info.world_size == 8);
  CHECK(c.info.local_rank == 1);
  CHECK(c.info.local_world_size == 4);
  CHECK(c.info.node_rank == 1);
  CHECK(c.info.master_addr == "node0");
  CHECK(c.info.master_port == 29400);
  vars["FULGUR_LAUNCHER"] = "1";
  CHECK(fulgur::detect_cluster_environment(lookup(vars)).kind == fulgur::ClusterKind::fulgur_launcher);
  // torchrun inside a SLURM allocation: torchrun's variables win.
  vars["SLURM_NTASKS"] = "2";
  vars["SLURM_PROCID"] = "0";
  CHECK(fulgur::detect_cluster_environment(lookup(vars)).info.global_rank == 5);
  vars["RANK"] = "8";
  auto e = fulgur::test::error_from([&] { fulgur::detect_cluster_environment(lookup(vars)); });
  CHECK(e.kind() == fulgur::ErrorKind::config);
  CHECK(contains(e.what(), "rank 8 is not below the world size 8"));
  vars["RANK"] = "x1";
  CHECK(contains(fulgur::test::error_from([&] { fulgur::detect_cluster_environment(lookup(vars)); }).what(),
                 "RANK=\"x1\""));
}

TEST_CASE("cluster environment: SLURM") {
  std::map<std::string, std::string> vars{{"SLURM_NTASKS", "8"},
                                          {"SLURM_PROCID", "6"},
                                          {"SLURM_LOCALID", "2"},
                                          {"SLURM_NODEID", "1"},
                                          {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                          {"SLURM_JOB_NODELIST", "gpu[017-018,20],login"},
                                          {"SLURM_JOB_ID", "1234567"},
                                          {"SLURM_JOB_NAME", "train"}};
  auto c = fulgur::detect_cluster_environment(lookup(vars));
  CHECK(c.kind == fulgur::ClusterKind::slurm);
  CHECK(c.info.global_rank == 6);
  CHECK(c.info.world_size == 8);
  CHECK(c.info.local_rank == 2);
  CHECK(c.info.local_world_size == 4);
  CHECK(c.info.node_rank == 1);
  CHECK(c.info.master_addr == "gpu017");
  CHECK(c.info.master_port == 15000 + 4567);
  vars["MASTER_PORT"] = "31000";
  CHECK(fulgur::detect_cluster_environment(lookup(vars)).info.master_port == 31000);
  // An interactive allocation's shell is not a task.
  vars["SLURM_JOB_NAME"] = "bash";
  CHECK(fulgur::detect_cluster_environment(lookup(vars)).kind == fulgur::ClusterKind::single_process);
  CHECK(fulgur::first_slurm_host("node7") == "node7");
  CHECK(fulgur::first_slurm_host("a[09-12]-ib,b1") == "a09-ib");
  CHECK(fulgur::first_slurm_host("x[3,5-7]") == "x3");
}

TEST_CASE("cluster environment: Open MPI and MPICH") {
  auto ompi = fulgur::detect_cluster_environment(lookup({{"OMPI_COMM_WORLD_RANK", "3"},
                                                         {"OMPI_COMM_WORLD_SIZE", "4"},
                                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  CHECK(ompi.kind == fulgur::ClusterKind::open_mpi);
  CHECK(ompi.info.global_rank == 3);
  CHECK(ompi.info.master_addr == "127.0.0.1");  // one node: loopback
  CHECK(ompi.info.master_port == 29500);
  auto multi_node = [] {
    fulgur::detect_cluster_environment(lookup({{"OMPI_COMM_WORLD_RANK", "0"},
                                               {"OMPI_COMM_WORLD_SIZE", "8"},
                                               {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  };
  CHECK(contains(fulgur::test::error_from(multi_node).what(), "MASTER_ADDR"));
  auto mpich = fulgur::detect_cluster_environment(lookup({{"PMI_RANK", "5"},
                                                          {"PMI_SIZE", "8"},
                                                          {"MPI_LOCALRANKID", "1"},
                                                          {"MPI_LOCALNRANKS", "4"},
                                                          {"MASTER_ADDR", "head"},
                                                          {"MASTER_PORT", "2000"}}));
  CHECK(mpich.kind == fulgur::ClusterKind::mpich);
  CHECK(mpich.info.node_rank == 1);
  CHECK(mpich.info.master_addr == "head");
  CHECK(mpich.info.master_port == 2000);
}

TEST_CASE("distributed sampler: each sample once per epoch across ranks, padded or dropped") {
  const int64_t n = 10;
  at::Tensor inputs = at::arange(n, at::kFloat).unsqueeze(1);
  at::Tensor targets = at::arange(n, at::kLong);
  for (bool drop_last : {false, true}) {
    for (bool shuffle : {false, true}) {
      std::multiset<int64_t> seen;
      std::set<int64_t> per_rank_counts;
      for (int64_t rank = 0; rank < 3; ++rank) {
        auto loader = fulgur::make_tensor_loader(
            inputs, targets, fulgur::TensorLoaderOptions().batch_size(2).shuffle(shuffle).seed(3).drop_last(drop_last));
        loader->set_replica(rank, 3);
        loader->start_epoch(1, 0);
        int64_t count = 0;
        while (auto batch = loader->next()) {
          for (int64_t i = 0; i < batch->target.size(0); ++i) seen.insert(batch->target[i].item<int64_t>());
          count += batch->target.size(0);
        }
        per_rank_counts.insert(count);
      }
      CAPTURE(drop_last);
      CAPTURE(shuffle);
      CHECK(per_rank_counts.size() == 1);  // every rank the same number of samples (no rank waits)
      std::set<int64_t> distinct(seen.begin(), seen.end());
      if (drop_last) {
        // 10 over 3 ranks: 3 each; each seen sample once; batch 2 drops each rank's last single.
        CHECK(seen.size() == 6);
        CHECK(distinct.size() == seen.size());
      } else {
        CHECK(distinct.size() == static_cast<size_t>(n));  // all covered
        CHECK(seen.size() == 12);                          // padded by repeating 2 samples
      }
    }
  }
}

// ---- elastic: resuming mid-epoch with another number of processes (issue #39) ---------------

namespace {

// The samples (first feature = index) each loader hands out until its epoch ends.
std::multiset<int64_t> drain(fulgur::BatchLoader& loader) {
  std::multiset<int64_t> seen;
  while (auto batch = loader.next())
    for (int64_t i = 0; i < batch->input.size(0); ++i) seen.insert(batch->input[i][0].item<int64_t>());
  return seen;
}

// Every "epoch step index" line of a run's samples_rank*.txt files, for steps before `before`.
std::map<int64_t, std::multiset<int64_t>> recorded_samples(const Run& run, int ranks, int64_t before = INT64_MAX) {
  std::map<int64_t, std::multiset<int64_t>> by_epoch;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(run.dir / fmt::format("samples_rank{}.txt", r));
    int64_t epoch, step, index;
    while (in >> epoch >> step >> index)
      if (step < before) by_epoch[epoch].insert(index);
  }
  return by_epoch;
}

void merge(std::map<int64_t, std::multiset<int64_t>>& into, const std::map<int64_t, std::multiset<int64_t>>& from) {
  for (const auto& [epoch, seen] : from) into[epoch].insert(seen.begin(), seen.end());
}

// Each of the worker's 96 rows exactly once.
std::multiset<int64_t> every_row_once() {
  std::multiset<int64_t> all;
  for (int64_t i = 0; i < 96; ++i) all.insert(i);
  return all;
}

std::string with_max_epochs(std::string toml, int epochs) {
  toml.replace(toml.find("max_epochs = 100"), 16, fmt::format("max_epochs = {}", epochs));
  return toml;
}

std::string checkpoint_every(int steps) {
  return fmt::format(
      "\n[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"ckpts\"\nfilename = \"{{step}}\"\n"
      "every_n_train_steps = {}\nsave_top_k = -1\n",
      steps);
}

}  // namespace

TEST_CASE(
    "elastic: the rest of an epoch is dealt to another number of replicas, padded or dropped as "
    "DistributedSampler") {
  // 11 samples, batch 2: 3 replicas hand out one batch each (6 samples), then 2 replicas deal the
  // other 5. Both loaders: the tensor fast path, and the threaded DataLoader with 2 workers.
  const at::Tensor inputs = at::arange(11, at::kFloat).unsqueeze(1);
  for (bool threaded : {false, true})
    for (bool drop_last : {false, true}) {
      CAPTURE(threaded);
      CAPTURE(drop_last);
      auto options = [&] {
        auto o = fulgur::TensorLoaderOptions().batch_size(2).shuffle(true).seed(3).drop_last(drop_last);
        if (threaded) o.num_workers(2).pin_memory(true);  // pin_memory: served by the DataLoader
        return o;
      };
      std::multiset<int64_t> seen;
      int64_t consumed = -1;
      int64_t first_of_epoch = -1;
      for (int64_t rank = 0; rank < 3; ++rank) {
        auto loader = fulgur::make_tensor_loader(inputs, at::Tensor(), options());
        loader->set_replica(rank, 3);
        loader->start_epoch(1, 0);
        auto batch = loader->next();
        REQUIRE(batch);
        if (rank == 0) first_of_epoch = batch->input[0][0].item<int64_t>();
        for (int64_t i = 0; i < batch->input.size(0); ++i) seen.insert(batch->input[i][0].item<int64_t>());
        fulgur::SamplePositionLoader* position = fulgur::sample_position_of(*loader);
        REQUIRE(position != nullptr);
        CHECK(position->epoch_samples() == 11);
        consumed = position->samples_consumed(1);
      }
      CHECK(consumed == 6);
      std::set<int64_t> per_rank_batches;
      for (int64_t rank = 0; rank < 2; ++rank) {
        auto loader = fulgur::make_tensor_loader(inputs, at::Tensor(), options());
        loader->set_replica(rank, 2);
        fulgur::SamplePositionLoader* position = fulgur::sample_position_of(*loader);
        REQUIRE(position != nullptr);
        per_rank_batches.insert(position->start_epoch_at_sample(1, consumed));
        const std::multiset<int64_t> rest = drain(*loader);
        seen.insert(rest.begin(), rest.end());
        CHECK(position->samples_consumed(1) == 10);  // 6 + one batch of 2 on each of 2 replicas
      }
      CHECK(per_rank_batches.size() == 1);  // every rank as many batches: none waits for the others
      const std::set<int64_t> distinct(seen.begin(), seen.end());
      if (drop_last) {
        // 5 over 2: 2 each, the tail's last sample dropped; nothing twice.
        CHECK(seen.size() == 10);
        CHECK(distinct.size() == 10);
      } else {
        // 3 each: padded with the epoch's first sample, which is seen twice (DistributedSampler).
        CHECK(seen.size() == 12);
        CHECK(distinct.size() == 11);
        CHECK(seen.count(first_of_epoch) == 2);
      }
    }
}

TEST_CASE("elastic: a streaming DataLoader says it has no global position, and refuses to be dealt again") {
  struct Stream : fulgur::data::IterableDataset {
    void start(int64_t, int64_t, int64_t) override { left = 4; }
    std::optional<fulgur::data::Sample> next() override {
      if (left-- <= 0) return std::nullopt;
      fulgur::data::Sample s;
      s.input = at::zeros({1});
      return s;
    }
    int64_t left = 0;
  };
  auto loader = fulgur::data::make_data_loader(std::make_shared<Stream>(), fulgur::data::DataLoaderOptions());
  fulgur::SamplePositionLoader* position = fulgur::sample_position_of(*loader);
  REQUIRE(position != nullptr);
  CHECK(position->epoch_samples() == -1);
  const fulgur::Error e = fulgur::test::error_from([&] { position->start_epoch_at_sample(0, 2); });
  FULGUR_CHECK_CONTAINS(e.what(), "iterable dataset");
  FULGUR_CHECK_CONTAINS(e.what(), "resume with the number of processes that wrote the checkpoint");
}

TEST_CASE("elastic: tar shards resume mid-epoch at another number of replicas, each sample once") {
  // 3 shards of 8 samples, batch 2. The replicas deal the one stream round robin across the
  // shards, so where every replica stands is one position in it: 3 replicas take 2 batches each
  // (shard 0 and half of shard 1), 2 replicas one batch each, 4 replicas the rest.
  TempDir dir;
  std::vector<fs::path> shards;
  for (int64_t shard = 0, index = 0; shard < 3; ++shard) {
    std::vector<std::pair<std::string, std::string>> members;
    for (int64_t i = 0; i < 8; ++i, ++index) {
      const std::string key = fmt::format("s{}/{:03}", shard, i);
      members.emplace_back(key + ".bin", "x");
      members.emplace_back(key + ".cls", std::to_string(index));
    }
    shards.push_back(dir / fmt::format("shard{}.tar", shard));
    fulgur::data::write_tar(shards.back(), members);
  }
  for (int64_t workers : {0, 2}) {
    CAPTURE(workers);
    auto make = [&](int64_t rank, int64_t replicas) {
      auto loader = fulgur::data::make_data_loader(
          std::make_shared<fulgur::data::TarShards>(shards, fulgur::data::TarShardOptions().input("bin")),
          fulgur::data::DataLoaderOptions().batch_size(2).num_workers(workers));
      loader->set_replica(rank, replicas);
      return loader;
    };
    std::multiset<int64_t> seen;
    auto take = [&](fulgur::BatchLoader& loader, int64_t batches) {
      for (int64_t b = 0; b < batches || batches < 0; ++b) {
        auto batch = loader.next();
        if (!batch) return b;
        for (int64_t i = 0; i < batch->target.size(0); ++i) seen.insert(batch->target[i].item<int64_t>());
      }
      return batches;
    };
    int64_t consumed = -1;
    for (int64_t rank = 0; rank < 3; ++rank) {
      auto loader = make(rank, 3);
      loader->start_epoch(0, 0);
      CHECK(take(*loader, 2) == 2);
      fulgur::SamplePositionLoader* position = fulgur::sample_position_of(*loader);
      REQUIRE(position != nullptr);
      CHECK(position->epoch_samples() == -1);  // a stream's length is not known
      consumed = position->samples_consumed(2);
    }
    CHECK(consumed == 12);
    for (int64_t rank = 0; rank < 2; ++rank) {
      auto loader = make(rank, 2);
      fulgur::SamplePositionLoader* position = fulgur::sample_position_of(*loader);
      CHECK(position->start_epoch_at_sample(0, 12) == -1);  // until the stream ends
      CHECK(take(*loader, 1) == 1);
      CHECK(position->samples_consumed(1) == 16);
    }
    for (int64_t rank = 0; rank < 4; ++rank) {
      auto loader = make(rank, 4);
      fulgur::sample_position_of(*loader)->start_epoch_at_sample(0, 16);
      CHECK(take(*loader, -1) == 1);  // 8 left: one batch of 2 each
    }
    std::multiset<int64_t> every;
    for (int64_t i = 0; i < 24; ++i) every.insert(i);
    CHECK(seen == every);
  }
}

TEST_CASE("elastic: a run reading tar shards goes on at another number of processes mid-epoch, each row once") {
  // The worker's 96 rows as 3 tar shards, streamed in order. 3 ranks train 4 steps of 12 rows
  // (all of shard 0, half of shard 1); 2 ranks train the other 48 (6 steps of 8) from there.
  TempDir shards;
  auto env = clean_env();
  env["FULGUR_TEST_RECORD_SAMPLES"] = "1";
  env["FULGUR_TEST_TAR_SHARDS"] = shards.path().string();
  auto first = run_worker(worker_config("ddp", "3", 4, 4) + checkpoint_every(4), {}, env);
  REQUIRE_SUCCESS(first);
  const fs::path at4 = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(at4), first->result.output);
  auto second = run_worker(with_max_epochs(worker_config("ddp", "2", 4, 100), 1), {"--resume", at4.string()}, env);
  REQUIRE_SUCCESS(second);
  CHECK(contains(second->result.output,
                 "resumed at step 4 of epoch 0 with 2 processes (was 3); the stream goes on from its sample 48"));
  CHECK(metrics(*second, 0).at("global_step") == 10);
  std::map<int64_t, std::multiset<int64_t>> seen = recorded_samples(*first, 3);
  merge(seen, recorded_samples(*second, 2));
  REQUIRE(seen.size() == 1);
  CHECK(seen[0] == every_row_once());
}

TEST_CASE("elastic: 3 ranks, one killed mid-epoch, go on at 2 and grow back to 3, every sample once per epoch") {
  // 96 rows, batch 4 per rank, shuffled. At 3 ranks a step takes 12 samples (8 steps an epoch),
  // at 2 ranks 8 (12 steps). The per-rank batch is kept, so the global batch follows the ranks.
  auto env = clean_env();
  env["FULGUR_TEST_RECORD_SAMPLES"] = "1";
  // 3 ranks to step 4 (48 samples of epoch 0), checkpoint there.
  auto first = run_worker(worker_config("ddp", "3", 4, 4, 1, true) + checkpoint_every(4), {}, env);
  REQUIRE_SUCCESS(first);
  const fs::path at4 = first->dir / "ckpts" / "step=4.ckpt";
  REQUIRE_MESSAGE(fs::exists(at4), first->result.output);
  // 2 ranks: the other 48 of epoch 0 (steps 5..10), then epoch 1 until rank 1 is killed at the
  // start of step 19; the last checkpoint is step 16, 6 steps (48 samples) into epoch 1.
  auto killed_env = env;
  killed_env["FULGUR_TEST_DIE_RANK"] = "1";
  killed_env["FULGUR_TEST_DIE_STEP"] = "18";
  auto second = run_worker(worker_config("ddp", "2", 4, 100, 1, true) + checkpoint_every(4), {"--resume", at4.string()},
                           killed_env);
  REQUIRE_MESSAGE(second->result.status != 0, second->result.output);
  CHECK(contains(second->result.output,
                 "resumed at step 4 of epoch 0 with 2 processes (was 3); 48 samples of this epoch remain"));
  CHECK(contains(second->result.output, "the global batch is now 8 samples per optimizer step (was 12)"));
  const fs::path at16 = second->dir / "ckpts" / "step=16.ckpt";
  REQUIRE_MESSAGE(fs::exists(at16), second->result.output);
  // Back to 3 ranks: the other 48 of epoch 1 (steps 17..20), and epoch 2 whole.
  auto third =
      run_worker(with_max_epochs(worker_config("ddp", "3", 4, 100, 1, true), 3), {"--resume", at16.string()}, env);
  REQUIRE_SUCCESS(third);
  CHECK(contains(third->result.output,
                 "resumed at step 16 of epoch 1 with 3 processes (was 2); 48 samples of this epoch remain"));
  CHECK(metrics(*third, 0).at("global_step") == 28);

  std::map<int64_t, std::multiset<int64_t>> seen = recorded_samples(*first, 3);
  merge(seen, recorded_samples(*second, 2, /*before=*/16));  // what came after step 16 is trained again
  merge(seen, recorded_samples(*third, 3));
  REQUIRE(seen.size() == 3);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    CAPTURE(epoch);
    CHECK(seen[epoch] == every_row_once());
  }
  // The same three epochs without interruption at 3 ranks: a different path (8 of the 28 steps
  // took 8 samples instead of 12), so the loss is close, not equal.
  auto whole = run_worker(with_max_epochs(worker_config("ddp", "3", 4, 100, 1, true), 3), {}, clean_env());
  REQUIRE_SUCCESS(whole);
  const double elastic_loss = metrics(*third, 0).at("val/loss"), whole_loss = metrics(*whole, 0).at("val/loss");
  MESSAGE("val/loss after 3 epochs: elastic ", elastic_loss, ", uninterrupted ", whole_loss);
  CHECK(std::abs(elastic_loss - whole_loss) < 0.1 * whole_loss);
}

TEST_CASE("elastic: a SLURM job requeued with fewer tasks resumes from its last checkpoint, each row once") {
  // The tasks start as srun starts them: together, each with SLURM_NTASKS, SLURM_PROCID and the
  // job's variables (no launcher, no MASTER_PORT: Fulgur derives it from the job id). 3 tasks train
  // to step 4 of epoch 0; the job is requeued (SLURM_RESTART_COUNT = 1) with 2 tasks, finds the
  // last checkpoint by itself and deals out the rest of the epoch.
  TempDir dir;
  const std::string checkpoints = checkpoint_every(4) + "save_last = true\n";
  fulgur::test::write_bytes(dir / "first.toml",
                            with_max_epochs(worker_config("ddp", "auto", 4, 4, 1, true), 1) + checkpoints);
  fulgur::test::write_bytes(dir / "second.toml",
                            with_max_epochs(worker_config("ddp", "auto", 4, 100, 1, true), 1) + checkpoints);
  const std::string job_id = std::to_string(700000 + ::getpid() % 50000);
  auto srun = [&](int tasks, const std::string& name, const std::string& restarts) {
    const fs::path out = dir / name;
    fs::create_directories(out);
    auto env = clean_env();
    env["FULGUR_TEST_RECORD_SAMPLES"] = "1";
    env["SLURM_NTASKS"] = std::to_string(tasks);
    env["SLURM_TASKS_PER_NODE"] = std::to_string(tasks);
    env["SLURM_NODEID"] = "0";
    env["SLURM_JOB_NODELIST"] = "localhost";
    env["SLURM_JOB_ID"] = job_id;
    env["SLURM_JOB_NAME"] = "train";
    if (!restarts.empty()) env["SLURM_RESTART_COUNT"] = restarts;
    const std::string tasks_script = fmt::format(
        "s=0; pids=; i=0; while [ $i -lt {} ]; do SLURM_PROCID=$i SLURM_LOCALID=$i \"$0\" \"$@\" & pids=\"$pids $!\"; "
        "i=$((i + 1)); done; for p in $pids; do wait $p || s=1; done; exit $s",
        tasks);
    return std::make_pair(run_process({"/bin/sh", "-c", tasks_script, FULGUR_TEST_DDP_WORKER,
                                       (dir / (name + ".toml")).string(), out.string()},
                                      env, dir / (name + ".log")),
                          out);
  };
  auto samples = [](const fs::path& out, int ranks) {
    std::multiset<int64_t> seen;
    for (int r = 0; r < ranks; ++r) {
      std::ifstream in(out / fmt::format("samples_rank{}.txt", r));
      int64_t epoch, step, index;
      while (in >> epoch >> step >> index)
        if (epoch == 0) seen.insert(index);
    }
    return seen;
  };
  const auto [first, first_out] = srun(3, "first", "");
  REQUIRE_MESSAGE(first.status == 0, first.output);
  REQUIRE_MESSAGE(fs::exists(dir / "ckpts" / "step=4.ckpt"), first.output);
  const auto [second, second_out] = srun(2, "second", "1");
  REQUIRE_MESSAGE(second.status == 0, second.output);
  CHECK(contains(second.output, "SLURM_RESTART_COUNT = 1: this job was restarted"));
  CHECK(contains(second.output,
                 "resumed at step 4 of epoch 0 with 2 processes (was 3); 48 samples of this epoch remain"));
  std::multiset<int64_t> seen = samples(first_out, 3);
  const std::multiset<int64_t> after = samples(second_out, 2);
  CHECK(after.size() == 48);
  seen.insert(after.begin(), after.end());
  CHECK(seen == every_row_once());
}

TEST_CASE("elastic: num_nodes = 0 takes as many nodes as the launcher started (torchrun --nnodes=MIN:MAX)") {
  // torchrun --standalone starts one node of 2 processes: num_nodes = 2 is refused, 0 accepts it.
  auto fixed = run_worker(with_trainer_line(worker_config("ddp", "auto", 8, 2), "num_nodes = 2"), {}, clean_env(),
                          /*torchrun=*/true);
  CHECK(fixed->result.status != 0);
  CHECK(contains(fixed->result.output, "[trainer] num_nodes = 2, but torchrun started 2 process(es) in all"));
  auto elastic = run_worker(with_trainer_line(worker_config("ddp", "auto", 8, 2), "num_nodes = 0"), {}, clean_env(),
                            /*torchrun=*/true);
  REQUIRE_SUCCESS(elastic);
  CHECK(metrics(*elastic, 1).at("global_step") == 2);
}

TEST_CASE("elastic: when torchrun restarted some ranks and not others, every rank resumes from the last checkpoint") {
  // torchrun counts restarts per agent: a node that replaced a lost one starts its workers with
  // TORCHELASTIC_RESTART_COUNT = 0 beside workers that say 1. Here rank 1 says 1 and rank 0 says
  // 0: both must resume (rank 0 training from scratch beside a resumed rank 1 would hang).
  TempDir dir;
  const std::string checkpoints = checkpoint_every(4) + "save_last = true\n";
  fulgur::test::write_bytes(dir / "first.toml", worker_config("ddp", "auto", 4, 4, 1, true) + checkpoints);
  fulgur::test::write_bytes(dir / "second.toml", worker_config("ddp", "auto", 4, 8, 1, true) + checkpoints);
  auto torchrun = [&](const char* config, const char* prefix) {
    return run_process({FULGUR_TEST_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--no-python", "/bin/sh", "-c", std::string(prefix) + "exec \"$0\" \"$@\"",
                        FULGUR_TEST_DDP_WORKER, (dir / config).string(), dir.path().string()},
                       clean_env(), dir / (std::string(config) + ".log"));
  };
  const ProcessResult first = torchrun("first.toml", "");
  REQUIRE_MESSAGE(first.status == 0, first.output);
  REQUIRE(fs::exists(dir / "ckpts" / "last.ckpt"));
  const ProcessResult second =
      torchrun("second.toml", "if [ \"$RANK\" = 1 ]; then export TORCHELASTIC_RESTART_COUNT=1; fi; ");
  REQUIRE_MESSAGE(second.status == 0, second.output);
  CHECK(contains(second.output, "TORCHELASTIC_RESTART_COUNT = 1: this job was restarted"));
  CHECK(contains(second.output, "another rank of this job was restarted, so fit resumes from the last checkpoint"));
  CHECK(contains(second.output, "(epoch 0, global step 4"));
  std::ifstream metrics0(dir / "metrics_rank0.txt");
  std::string key;
  double value = -1, step = -1;
  while (metrics0 >> key >> value)
    if (key == "global_step") step = value;
  CHECK(step == 8);
}

// Checkpoints written mid-epoch at S ranks resume at T ranks under ddp (full checkpoints) and
// fsdp ZeRO-3 (sharded, each rank reading its rows): the epoch's samples are each seen once. All
// 18 cells: 24 short runs, about 30 s on 2 cores. ZeRO-1 (full checkpoints) and ZeRO-2 (sharded)
// run a shrinking and a growing cell each.
TEST_CASE(
    "elastic: resharding matrix, mid-epoch checkpoints at 1, 2, 3 ranks resume at 1, 2, 3 under ddp and "
    "fsdp ZeRO-3, and across sizes under ZeRO-1 and ZeRO-2") {
  struct Strategy {
    std::string name;
    std::map<std::string, std::string> env;
    std::string option;                   // a line for [strategy]
    std::set<std::pair<int, int>> cells;  // (from, to); empty: all nine
  };
  auto ddp_env = clean_env();
  auto fsdp_env = block_env();
  for (auto* e : {&ddp_env, &fsdp_env}) (*e)["FULGUR_TEST_RECORD_SAMPLES"] = "1";
  const std::vector<Strategy> strategies = {
      {"ddp", ddp_env, "", {}},
      {"fsdp:3", fsdp_env, "state_dict_type = \"sharded\"", {}},
      {"fsdp:1", fsdp_env, "", {{3, 2}, {2, 3}}},
      {"fsdp:2", fsdp_env, "state_dict_type = \"sharded\"", {{3, 2}, {1, 3}}},
  };
  for (const Strategy& strategy : strategies) {
    CAPTURE(strategy.name);
    auto wanted = [&](int from, int to) { return strategy.cells.empty() || strategy.cells.contains({from, to}); };
    for (int from = 1; from <= 3; ++from) {
      if (!wanted(from, 1) && !wanted(from, 2) && !wanted(from, 3)) continue;
      CAPTURE(from);
      // 96 rows, batch 4 per rank: 3 steps are 12 x from samples, so what is left (96 - 12 from)
      // divides among 1, 2 and 3 ranks without padding.
      auto config = [&](int ranks) {
        std::string toml = with_max_epochs(worker_config(strategy.name, std::to_string(ranks), 4, 100, 1, true), 1);
        return strategy.option.empty() ? toml : with_strategy_option(toml, strategy.option);
      };
      std::string first_toml = worker_config(strategy.name, std::to_string(from), 4, 3, 1, true);
      if (!strategy.option.empty()) first_toml = with_strategy_option(first_toml, strategy.option);
      auto first = run_worker(first_toml + checkpoint_every(3), {}, strategy.env);
      REQUIRE_SUCCESS(first);
      const fs::path ckpt = first->dir / "ckpts" / "step=3.ckpt";
      REQUIRE_MESSAGE(fs::exists(ckpt), first->result.output);
      for (int to = 1; to <= 3; ++to) {
        if (!wanted(from, to)) continue;
        CAPTURE(to);
        auto resumed = run_worker(config(to), {"--resume", ckpt.string()}, strategy.env);
        REQUIRE_SUCCESS(resumed);
        const int64_t left = 96 - 12 * from;
        CHECK(contains(resumed->result.output,
                       fmt::format("resumed at step 3 of epoch 0 with {} processes (was {}); {} samples of this "
                                   "epoch remain",
                                   to, from, left)));
        std::map<int64_t, std::multiset<int64_t>> seen = recorded_samples(*first, from);
        merge(seen, recorded_samples(*resumed, to));
        REQUIRE(seen.size() == 1);
        CHECK(seen[0] == every_row_once());
        // Every rank ends with the same weights (ZeRO-3's are gathered whole for the file).
        for (int r = 1; r < to; ++r) CHECK(max_difference(weights(*resumed, 0), weights(*resumed, r)) == 0.0);
      }
    }
  }
}

TEST_CASE(
    "nccl: the core opens libfulgur_nccl.so when a process group first asks for NCCL, and NCCL's own refusal comes "
    "back as a Fulgur error") {
  // A CPU run never loads libtorch_cuda (see the start-up test); NCCL lives in a library of its own.
#if FULGUR_TEST_HAS_CUDA_PLUGIN
  const c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  try {
    const auto backend = fulgur::detail::make_nccl_backend(store, 0, 1, std::chrono::seconds(5));
    CHECK(backend);  // a machine with a GPU: a one-rank NCCL group
    CHECK(torch::cuda::is_available());
  } catch (const fulgur::Error& e) {
    // No GPU here: the library loaded (its entry point ran) and ProcessGroupNCCL refused.
    CHECK(e.kind() == fulgur::ErrorKind::distributed);
    FULGUR_CHECK_CONTAINS(std::string(e.what()), "NCCL process group: ");
    FULGUR_CHECK_CONTAINS(std::string(e.what()), "GPU");
  }
#else
  fulgur::test::skip_test("this build has no CUDA torch, hence no libfulgur_nccl.so");
#endif
}
