// Tensor and sequence parallelism (fulgur/device_mesh.h, fulgur/nn/tensor_parallel.h) on 2 and 4
// Gloo processes over loopback: every rank runs tests/tp_worker.cpp, which compares the parallel
// layers with the same model computed whole in one process and prints what it found.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fulgur/checkpoint_io.h>
#include <fulgur/device_mesh.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>
#include <fulgur/nn/tensor_parallel.h>

#include "test_support.h"

namespace {

using fulgur::test::TempDir;
namespace fs = std::filesystem;

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  close(fd);
  return ntohs(addr.sin_port);
}

struct Rank {
  int status = -1;
  std::string output;
  std::map<std::string, double> diffs;  // `diff <name> <value>`
  std::map<std::string, int> checks;    // `check <name> <0|1>`
};

// Runs `scenario` on `world` ranks; kills them all after two minutes (a hang fails the test).
std::vector<Rank> run_ranks(const std::string& scenario, int world, int tp_size = 2) {
  TempDir dir;
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const std::map<std::string, std::string> env{{"RANK", std::to_string(r)},
                                                 {"WORLD_SIZE", std::to_string(world)},
                                                 {"MASTER_ADDR", "127.0.0.1"},
                                                 {"MASTER_PORT", std::to_string(port)},
                                                 {"FULGUR_TEST_TP_SIZE", std::to_string(tp_size)},
                                                 {"OMP_NUM_THREADS", "1"},
                                                 {"GLOO_SOCKET_IFNAME", ""}};
    pids.push_back(fulgur::test::spawn_process({FULGUR_TEST_TP_WORKER, scenario}, env, dir.path(),
                                               dir.path() / fmt::format("rank{}.log", r)));
  }
  std::vector<Rank> ranks(static_cast<size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  for (int r = 0; r < world; ++r) {
    int status = 0;
    while (waitpid(pids[r], &status, WNOHANG) != pids[r]) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : pids) kill(p, SIGKILL);
        waitpid(pids[r], &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Rank& rank = ranks[static_cast<size_t>(r)];
    rank.status = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    rank.output = fulgur::test::read_bytes(dir.path() / fmt::format("rank{}.log", r));
    std::istringstream lines(rank.output);
    std::string kind, name;
    for (std::string line; std::getline(lines, line);) {
      std::istringstream words(line);
      double value = 0;
      if (!(words >> kind >> name >> value)) continue;
      if (kind == "diff") rank.diffs[name] = value;
      if (kind == "check") rank.checks[name] = static_cast<int>(value);
    }
  }
  return ranks;
}

// Every rank exited 0, printed each of `diffs` at most `tolerance` and each of `checks` true.
void require_all(const std::vector<Rank>& ranks, const std::vector<std::string>& diffs,
                 const std::vector<std::string>& checks, double tolerance = 1e-5) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    INFO("rank " << r << " output:\n" << ranks[r].output);
    REQUIRE(ranks[r].status == 0);
    for (const auto& name : diffs) {
      INFO(name);
      REQUIRE(ranks[r].diffs.count(name) == 1);
      CHECK(ranks[r].diffs.at(name) <= tolerance);
    }
    for (const auto& name : checks) {
      INFO(name);
      REQUIRE(ranks[r].checks.count(name) == 1);
      CHECK(ranks[r].checks.at(name) == 1);
    }
  }
}

const std::vector<std::string> kMlpDiffs{
    "init_col_weight",    "init_row_weight",    "init_row_bias",   "output",     "grad_col_weight",
    "grad_col_bias",      "grad_row_weight",    "grad_row_bias",   "grad_input", "grad_norm_relative",
    "clipped_col_weight", "clipped_row_weight", "clipped_row_bias"};

}  // namespace

TEST_CASE("tensor parallel: the device mesh lays out ranks as init_device_mesh (2 x 2)") {
  require_all(run_ranks("mesh", 4), {},
              {"mesh_tp_ranks", "mesh_dp_ranks", "mesh_coordinate", "mesh_local_ranks", "mesh_tp_all_reduce",
               "mesh_dp_all_reduce"});
}

TEST_CASE("tensor parallel: a column-row MLP equals one process (tp 2)") {
  require_all(run_ranks("mlp", 2), kMlpDiffs, {});
}

TEST_CASE("tensor parallel: a column-row MLP equals one process (dp 2 x tp 2)") {
  require_all(run_ranks("mlp", 4), kMlpDiffs, {});
}

TEST_CASE("tensor parallel: sequence parallel LayerNorm and MLP equal one process (tp 2)") {
  std::vector<std::string> diffs = kMlpDiffs;
  diffs.insert(diffs.end(), {"grad_norm_weight", "grad_norm_bias"});
  require_all(run_ranks("mlp_sp", 2), diffs, {});
}

TEST_CASE("tensor parallel: sequence parallel LayerNorm and MLP equal one process (dp 2 x tp 2)") {
  std::vector<std::string> diffs = kMlpDiffs;
  diffs.insert(diffs.end(), {"grad_norm_weight", "grad_norm_bias"});
  require_all(run_ranks("mlp_sp", 4), diffs, {});
}

TEST_CASE("tensor parallel: sequence parallel LayerNorm and MLP equal one process (tp 4)") {
  std::vector<std::string> diffs = kMlpDiffs;
  diffs.insert(diffs.end(), {"grad_norm_weight", "grad_norm_bias"});
  require_all(run_ranks("mlp_sp", 4, 4), diffs, {});
}

TEST_CASE("tensor parallel: 20 AdamW steps on dp 2 x tp 2 with sequence parallelism and clipping equal one process") {
  const std::vector<std::string> diffs{"train_loss",     "train_col_weight",  "train_col_bias", "train_row_weight",
                                       "train_row_bias", "train_norm_weight", "train_norm_bias"};
  require_all(run_ranks("train", 4), diffs, {"train_weights_moved", "train_clipping_engaged"});
  require_all(run_ranks("train", 2), diffs, {"train_weights_moved", "train_clipping_engaged"});
}

TEST_CASE("tensor parallel: sizes that do not split and a mesh that does not fit are clear errors") {
  require_all(run_ranks("errors", 2), {}, {"error_column_split", "error_vocab_split", "error_mesh_size"});
}

TEST_CASE("tensor parallel: vocab-parallel embedding and cross-entropy equal one process (tp 2 and tp 4)") {
  std::vector<std::string> diffs;
  std::vector<std::string> checks;
  for (std::string tag : {"", "sp_"}) {
    for (const char* name : {"init_embedding", "init_head", "logits", "loss", "grad_embedding", "grad_head"})
      diffs.push_back(tag + name);
    checks.push_back(tag + "logits_stay_split");
  }
  require_all(run_ranks("vocab", 2), diffs, checks);
  require_all(run_ranks("vocab", 4, 4), diffs, checks);
}

TEST_CASE("tensor parallel: dropout differs in sharded regions and matches in replicated ones") {
  require_all(run_ranks("rng", 2), {},
              {"rng_sharded_differs_across_tp", "rng_replicated_equal_across_tp", "rng_stream_advances",
               "rng_default_stream_untouched", "rng_sharded_reproducible"});
}

TEST_CASE("tensor parallel: mesh layout of a 2 x 3 x 2 mesh matches init_device_mesh") {
  // torch.arange(12).view(2, 3, 2): the group along a dimension varies that index only.
  const std::vector<int64_t> shape{2, 3, 2};
  CHECK(fulgur::DeviceMesh::group_ranks(shape, 7, 0) == std::vector<int64_t>{1, 7});
  CHECK(fulgur::DeviceMesh::group_ranks(shape, 7, 1) == std::vector<int64_t>{7, 9, 11});
  CHECK(fulgur::DeviceMesh::group_ranks(shape, 7, 2) == std::vector<int64_t>{6, 7});
  CHECK(fulgur::DeviceMesh::coordinate_of(shape, 7) == std::vector<int64_t>{1, 0, 1});
  const auto mesh = fulgur::DeviceMesh::from_groups(7, shape, {"pp", "dp", "tp"}, {nullptr, nullptr, nullptr});
  CHECK(mesh.size("dp") == 3);
  CHECK(mesh.local_rank("tp") == 1);
  CHECK(mesh.group_ranks("dp") == std::vector<int64_t>{7, 9, 11});
  const auto unknown = fulgur::test::error_from([&] { mesh.dim("ep"); });
  CHECK(unknown.kind() == fulgur::ErrorKind::invalid_argument);
  CHECK(fulgur::test::contains(unknown.what(), "no dimension 'ep'; the mesh has (pp, dp, tp)"));
  const auto duplicate = fulgur::test::error_from([] {
    fulgur::DeviceMesh::from_groups(0, {1, 1}, {"tp", "tp"}, {nullptr, nullptr});
  });
  CHECK(fulgur::test::contains(duplicate.what(), "distinct"));
}

TEST_CASE("tensor parallel: with one rank the layers are torch::nn::Linear and Embedding") {
  torch::manual_seed(3);
  torch::nn::Linear linear(6, 4);
  torch::manual_seed(3);
  fulgur::nn::ColumnParallelLinear column(fulgur::nn::ParallelLinearOptions(6, 4));
  torch::manual_seed(3);
  fulgur::nn::RowParallelLinear row(fulgur::nn::ParallelLinearOptions(6, 4));
  const at::Tensor x = torch::randn({5, 6});
  CHECK(column(x).equal(linear(x)));
  CHECK(torch::allclose(row(x), linear(x), 1e-6, 1e-6));  // matmul then bias, not addmm
  // State dict names and shapes are torch.nn.Linear's.
  const auto names = column->named_parameters();
  CHECK(names.contains("weight"));
  CHECK(names.contains("bias"));
  CHECK(names["weight"].sizes() == linear->weight.sizes());
  torch::manual_seed(5);
  torch::nn::Embedding embedding(10, 3);
  torch::manual_seed(5);
  fulgur::nn::VocabParallelEmbedding vocab(fulgur::nn::VocabParallelEmbeddingOptions(10, 3));
  const at::Tensor ids = torch::tensor({0, 9, 4});
  CHECK(vocab(ids).equal(embedding(ids)));
  const at::Tensor logits = torch::randn({3, 10}, torch::requires_grad());
  const at::Tensor target = torch::tensor({1, 2, 9});
  const at::Tensor loss = fulgur::nn::vocab_parallel_cross_entropy(logits, target, nullptr).mean();
  CHECK(torch::allclose(loss, torch::nn::functional::cross_entropy(logits, target)));
  const auto mismatch = fulgur::test::error_from([&] {
    fulgur::nn::vocab_parallel_cross_entropy(logits, torch::tensor({1, 2}), nullptr);
  });
  CHECK(fulgur::test::contains(mismatch.what(), "do not fit"));
}

namespace {

// `fulgur fit` of the tp_mlp fixture on tp_regression under `strategy_table` with `devices`
// processes, 10 SGD steps with norm clipping at 0.05 (engaged from the first step); returns the
// metrics.csv columns (rank 0's values).
std::map<std::string, std::vector<std::string>> fit_tp_mlp(
    const std::string& strategy_table, int devices, const std::string& trainer_extra = "enable_checkpointing = false",
    fulgur::test::ProcessRun* run_out = nullptr) {
  TempDir dir;
  const fs::path plugins = dir.subdir("plugins");
  for (const char* library : {"libfulgur-fixture-tp-mlp.so", "libfulgur-fixture-tp-regression.so"})
    fulgur::test::copy_library(fulgur::test::fixture(library), plugins / library);
  fulgur::test::write_bytes(
      dir / "run.toml",
      fmt::format("[trainer]\nmax_epochs = 1\nseed = 7\nlimit_train_batches = 10\nnum_sanity_val_steps = 0\n"
                  "log_every_n_steps = 1\ngradient_clip_val = 0.05\nenable_progress_bar = false\n"
                  "enable_model_summary = false\naccelerator = \"cpu\"\ndevices = {}\n"
                  "default_root_dir = \"{}\"\n{}\n[strategy]\n{}\n\n"
                  "[model]\nname = \"tp_mlp\"\nlr = 0.1\n\n[data]\nname = \"tp_regression\"\n"
                  "batch_size = 16\n\n[[loggers]]\nname = \"csv\"\n",
                  devices, (dir / "runs").string(), trainer_extra, strategy_table));
  const fulgur::test::ProcessRun run = fulgur::test::run_process(
      {FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"},
      {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", plugins.string()}, {"OMP_NUM_THREADS", "1"}}, dir.path());
  if (run_out != nullptr) {
    *run_out = run;
    return {};
  }
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  return fulgur::test::read_csv(dir / "runs" / "lightning_logs" / "version_0" / "metrics.csv");
}

std::vector<double> column(const std::map<std::string, std::vector<std::string>>& csv, const std::string& name) {
  REQUIRE(csv.count(name) == 1);
  std::vector<double> values;
  for (const auto& cell : csv.at(name))
    if (!cell.empty()) values.push_back(std::stod(cell));
  return values;
}

void require_same_losses(const std::map<std::string, std::vector<std::string>>& a,
                         const std::map<std::string, std::vector<std::string>>& b) {
  const std::vector<double> la = column(a, "train/loss"), lb = column(b, "train/loss");
  REQUIRE(la.size() >= 8);  // 10 steps; 8 with two replicas (256 rows / 2 / 16)
  REQUIRE(lb.size() == la.size());
  for (size_t i = 0; i < la.size(); ++i) {
    INFO("step " << i);
    CHECK(std::abs(la[i] - lb[i]) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("model_parallel: fulgur fit with tensor_parallel_size 2 equals single_device and 2 x 2 equals ddp") {
  const auto single = fit_tp_mlp("name = \"single_device\"", 1);
  const auto tp2 = fit_tp_mlp("name = \"model_parallel\"\ntensor_parallel_size = 2\ntimeout = 60.0", 2);
  require_same_losses(single, tp2);
  CHECK(column(single, "shard/col_rows").front() == 32);
  CHECK(column(tp2, "shard/col_rows").front() == 16);  // the layer really is split

  // Two replicas of a 2-way split model train as two ddp replicas of the whole model.
  const auto ddp = fit_tp_mlp("name = \"ddp\"\ntimeout = 60.0", 2);
  const auto mesh =
      fit_tp_mlp("name = \"model_parallel\"\ntensor_parallel_size = 2\ndata_parallel_size = 2\ntimeout = 60.0", 4);
  require_same_losses(ddp, mesh);
  CHECK(column(mesh, "shard/col_rows").front() == 16);
}

TEST_CASE("model_parallel: a mesh that does not fit the job is a clear error") {
  fulgur::test::ProcessRun run;
  fit_tp_mlp("name = \"model_parallel\"\ntensor_parallel_size = 2\ndata_parallel_size = 2\ntimeout = 60.0", 2,
             "enable_checkpointing = false", &run);
  CHECK(run.exit_code != 0);
  CHECK(fulgur::test::contains(run.output,
                               "data_parallel_size 2 x tensor_parallel_size 2 = 4 ranks, but the job "
                               "has 2 processes"));
}

TEST_CASE("model_parallel: a zero_stage out of range is a clear error") {
  fulgur::test::ProcessRun run;
  fit_tp_mlp("name = \"model_parallel\"\ntensor_parallel_size = 2\nzero_stage = 4\ntimeout = 60.0", 2,
             "enable_checkpointing = false", &run);
  CHECK(run.exit_code != 0);
  CHECK(fulgur::test::contains(run.output,
                               "zero_stage = 4 is not one of 0 (no sharding over dp), 1 (optimizer "
                               "state), 2 (and gradients) or 3 (and parameters)"));
}

namespace {

constexpr const char* kTp2 = "name = \"model_parallel\"\ntensor_parallel_size = 2\ntimeout = 60.0";
constexpr const char* kTp2Dp2 =
    "name = \"model_parallel\"\ntensor_parallel_size = 2\ndata_parallel_size = 2\ntimeout = 60.0";
// The same with the optimizer state and gradients sharded over dp (ZeRO-2 across, TP inside).
constexpr const char* kTp2Dp2Zero2 =
    "name = \"model_parallel\"\ntensor_parallel_size = 2\ndata_parallel_size = 2\nzero_stage = 2\ntimeout = 60.0";
// And the parameters too (ZeRO-3 across: rows over dp, gathered around each block).
constexpr const char* kTp2Dp2Zero3 =
    "name = \"model_parallel\"\ntensor_parallel_size = 2\ndata_parallel_size = 2\nzero_stage = 3\ntimeout = 60.0";

// A job for fit_checkpointed: its [trainer] lines (ckpt_path), model_checkpoint lines and other
// callbacks.
struct JobExtras {
  std::string trainer;
  std::string checkpoint;  // default: a last.ckpt after each epoch
  std::string callbacks;
  std::string optimizer = "adamw";  // tp_mlp's: "adamw", "sgd", "muon" or "lbfgs"
};

// `fulgur fit` of tp_mlp (AdamW, so the optimizer has per-parameter state) on tp_regression in
// `dir`: `epochs` epochs of 10 steps (8 with two replicas), clipped by norm, last.ckpt in dir/ckpt;
// the run must succeed unless `run_out` takes it.
fulgur::test::ProcessRun fit_checkpointed(const fs::path& dir, const fs::path& plugins, const std::string& strategy,
                                          int devices, int epochs, const JobExtras& extras = {},
                                          bool must_succeed = true) {
  fs::create_directories(dir);
  fulgur::test::write_bytes(
      dir / "run.toml",
      fmt::format("[trainer]\nmax_epochs = {}\nseed = 7\nlimit_train_batches = 10\nnum_sanity_val_steps = 0\n"
                  "log_every_n_steps = 1\ngradient_clip_val = 0.5\nenable_progress_bar = false\n"
                  "enable_model_summary = false\naccelerator = \"cpu\"\ndevices = {}\n"
                  "default_root_dir = \"{}\"\n{}\n[strategy]\n{}\n\n"
                  "[model]\nname = \"tp_mlp\"\nlr = 0.01\noptimizer = \"{}\"\n\n"
                  "[data]\nname = \"tp_regression\"\nbatch_size = 16\n\n[[loggers]]\nname = \"csv\"\n\n"
                  "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"{}\"\nsave_top_k = 0\n"
                  "save_last = true\n{}\n{}",
                  epochs, devices, (dir / "runs").string(), extras.trainer, strategy, extras.optimizer,
                  (dir / "ckpt").string(), extras.checkpoint, extras.callbacks));
  fulgur::test::ProcessRun run = fulgur::test::run_process(
      {FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"},
      {{"FULGUR_LOG_LEVEL", "info"}, {"FULGUR_PLUGIN_PATH", plugins.string()}, {"OMP_NUM_THREADS", "1"}}, dir);
  if (must_succeed) {
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
  }
  return run;
}

fs::path tp_plugins(const TempDir& dir) {
  const fs::path plugins = dir.subdir("plugins");
  for (const char* library :
       {"libfulgur-fixture-tp-mlp.so", "libfulgur-fixture-tp-regression.so", "libfulgur-fixture-kill-at-step.so"})
    fulgur::test::copy_library(fulgur::test::fixture(library), plugins / library);
  return plugins;
}

// Every model and optimizer tensor of two DCP checkpoints, bit for bit; returns how many.
int64_t require_same_tensors(const fs::path& a, const fs::path& b) {
  REQUIRE(fulgur::dcp::is_distributed_checkpoint(a.string()));
  REQUIRE(fulgur::dcp::is_distributed_checkpoint(b.string()));
  const fulgur::dcp::Reader ra(a.string()), rb(b.string());
  int64_t compared = 0;
  for (const std::string& key : ra.keys()) {
    if (!(key.starts_with("state_dict.") || key.starts_with("optimizer_states.")) || !ra.is_tensor(key)) continue;
    INFO(key);
    REQUIRE(rb.contains(key));
    CHECK(at::equal(ra.read(key), rb.read(key)));
    ++compared;
  }
  return compared;
}

std::vector<double> csv_column(const fs::path& run_dir, const std::string& name) {
  return column(fulgur::test::read_csv(run_dir / "runs" / "lightning_logs" / "version_0" / "metrics.csv"), name);
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double tolerance) {
  REQUIRE(!a.empty());
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    CHECK(std::abs(a[i] - b[i]) <= tolerance);
  }
}

}  // namespace

TEST_CASE(
    "model_parallel: tp 2, dp 2 x tp 2 and dp 2 x tp 2 with zero_stage 2 and 3 killed mid-epoch resume from \"last\" "
    "bit for bit") {
  TempDir dir;
  const fs::path plugins = tp_plugins(dir);
  for (const auto& [strategy, devices, name] : {std::tuple<std::string, int, std::string>{kTp2, 2, "tp2"},
                                                {kTp2Dp2, 4, "dp2_tp2"},
                                                {kTp2Dp2Zero2, 4, "dp2_tp2_zero2"},
                                                {kTp2Dp2Zero3, 4, "dp2_tp2_zero3"}}) {
    INFO(strategy);
    const fs::path reference = dir / ("reference_" + name), work = dir / ("work_" + name);
    JobExtras extras{"ckpt_path = \"last\"", "every_n_train_steps = 4", ""};
    fit_checkpointed(reference, plugins, strategy, devices, 2, extras);
    // Every rank SIGKILLs itself after step 6: last.ckpt holds step 4, mid-epoch.
    extras.callbacks = fmt::format("[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = 6\nmarker = \"{}\"\n",
                                   (work / "killed").string());
    const auto killed = fit_checkpointed(work, plugins, strategy, devices, 2, extras, /*must_succeed=*/false);
    INFO(killed.output);
    REQUIRE(killed.exit_code == -SIGKILL);
    // Every rank wrote its own shard: one data file per rank, nothing gathered.
    for (int rank = 0; rank < devices; ++rank)
      CHECK(fs::exists(work / "ckpt" / "last.ckpt" / fmt::format("__{}_0.distcp", rank)));
    const auto resumed = fit_checkpointed(work, plugins, strategy, devices, 2, extras);
    CHECK(fulgur::test::contains(resumed.output, "global step 4, 4 batches into the epoch"));
    // col.weight/bias, row.weight/bias and their exp_avg and exp_avg_sq ("step" is a value).
    CHECK(require_same_tensors(reference / "ckpt" / "last.ckpt", work / "ckpt" / "last.ckpt") >= 12);
  }
}

TEST_CASE("model_parallel: a tp 2 checkpoint loads under single_device and dp 2 x tp 2, a whole one under tp 2") {
  TempDir dir;
  const fs::path plugins = tp_plugins(dir);
  fit_checkpointed(dir / "single", plugins, "name = \"single_device\"", 1, 1);
  fit_checkpointed(dir / "tp2", plugins, kTp2, 2, 1);
  const fs::path whole = dir / "single" / "ckpt" / "last.ckpt", split = dir / "tp2" / "ckpt" / "last.ckpt";
  REQUIRE(fs::is_regular_file(whole));
  REQUIRE(fulgur::dcp::is_distributed_checkpoint(split.string()));
  // The split checkpoint holds the whole tensors one process trained (10 AdamW steps apart by
  // float rounding only): each shard is where it belongs.
  {
    const c10::IValue one = fulgur::read_checkpoint_file(whole.string());
    const fulgur::dcp::Reader reader(split.string());
    for (const auto& entry : one.toGenericDict().at("state_dict").toGenericDict()) {
      INFO(entry.key().toStringRef());
      const at::Tensor read = reader.read("state_dict." + entry.key().toStringRef());
      CHECK(read.sizes() == entry.value().toTensor().sizes());
      CHECK(torch::allclose(read, entry.value().toTensor(), 0, 1e-5));
    }
  }
  auto resume = [&](const std::string& name, const std::string& strategy, int devices, const fs::path& from) {
    fit_checkpointed(dir / name, plugins, strategy, devices, 2, {fmt::format("ckpt_path = \"{}\"", from.string())});
    return csv_column(dir / name, "train/loss");
  };
  const auto single_from_whole = resume("single_from_whole", "name = \"single_device\"", 1, whole);
  REQUIRE(single_from_whole.size() == 10);  // the second epoch
  require_close(resume("single_from_tp2", "name = \"single_device\"", 1, split), single_from_whole, 1e-5);
  require_close(resume("tp2_from_whole", kTp2, 2, whole), single_from_whole, 1e-5);
  // Two replicas of the split model train as ddp does.
  const auto ddp_from_whole = resume("ddp_from_whole", "name = \"ddp\"\ntimeout = 60.0", 2, whole);
  require_close(resume("mesh_from_tp2", kTp2Dp2, 4, split), ddp_from_whole, 1e-5);
  // Sharded over dp too: each rank reads its rows of the tp shard's optimizer state.
  require_close(resume("mesh_zero2_from_tp2", kTp2Dp2Zero2, 4, split), ddp_from_whole, 1e-5);
  require_close(resume("mesh_zero2_from_whole", kTp2Dp2Zero2, 4, whole), ddp_from_whole, 1e-5);
}

TEST_CASE("model_parallel: zero_stage 2 writes the dp 2 x tp 2 layout, read by one process and without it") {
  TempDir dir;
  const fs::path plugins = tp_plugins(dir);
  fit_checkpointed(dir / "mesh", plugins, kTp2Dp2, 4, 1);
  fit_checkpointed(dir / "zero2", plugins, kTp2Dp2Zero2, 4, 1);
  const fs::path mesh = dir / "mesh" / "ckpt" / "last.ckpt", zero2 = dir / "zero2" / "ckpt" / "last.ckpt";
  // The same tensors under the same keys as without sharding over dp (the reductions' order apart):
  // the optimizer state each dp rank kept is its rows, where FSDP2 + TP puts them.
  {
    const fulgur::dcp::Reader a(mesh.string()), b(zero2.string());
    int64_t compared = 0;
    for (const std::string& key : a.keys()) {
      if (!(key.starts_with("state_dict.") || key.starts_with("optimizer_states.")) || !a.is_tensor(key)) continue;
      INFO(key);
      REQUIRE(b.contains(key));
      CHECK(torch::allclose(a.read(key), b.read(key), 0, 1e-5));
      ++compared;
    }
    CHECK(compared >= 12);
    CHECK(b.keys().size() == a.keys().size());
  }
  auto resume = [&](const std::string& name, const std::string& strategy, int devices, const fs::path& from) {
    fit_checkpointed(dir / name, plugins, strategy, devices, 2, {fmt::format("ckpt_path = \"{}\"", from.string())});
    return csv_column(dir / name, "train/loss");
  };
  // One process resumes from it as from the unsharded one.
  const auto single_from_mesh = resume("single_from_mesh", "name = \"single_device\"", 1, mesh);
  REQUIRE(single_from_mesh.size() == 10);
  require_close(resume("single_from_zero2", "name = \"single_device\"", 1, zero2), single_from_mesh, 1e-5);
  // And dp 2 x tp 2 without sharding over dp resumes from it as from its own.
  require_close(resume("mesh_from_zero2", kTp2Dp2, 4, zero2), resume("mesh_from_mesh", kTp2Dp2, 4, mesh), 1e-5);
}

TEST_CASE(
    "model_parallel: Muon's state is saved chunked like the parameters at tp 2 and resumes bit for bit after SIGKILL, "
    "and LBFGS is refused with the reason") {
  TempDir dir;
  const fs::path plugins = tp_plugins(dir);
  const fs::path reference = dir / "reference", work = dir / "work";
  JobExtras extras{"ckpt_path = \"last\"", "every_n_train_steps = 4", "", "muon"};
  fit_checkpointed(reference, plugins, kTp2, 2, 2, extras);
  // Muon's momentum (the weights) and AdamW moments (the biases) in the FSDP2 + TP layout: whole
  // tensors of the parameters' shapes, each tp rank having written its shard.
  {
    const fulgur::dcp::Reader written((reference / "ckpt" / "last.ckpt").string());
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const std::string& key : written.keys())
      if (key.starts_with("optimizer_states.0.state.")) shapes[key] = written.shape(key);
    // Groups: [col.weight, row.weight] (Muon), [col.bias, row.bias] (AdamW).
    CHECK(shapes["optimizer_states.0.state.0.momentum_buffer"] == std::vector<int64_t>{32, 8});
    CHECK(shapes["optimizer_states.0.state.1.momentum_buffer"] == std::vector<int64_t>{4, 32});
    CHECK(shapes["optimizer_states.0.state.2.exp_avg"] == std::vector<int64_t>{32});
    CHECK(shapes["optimizer_states.0.state.3.exp_avg_sq"] == std::vector<int64_t>{4});
  }
  // Every rank SIGKILLs itself after step 6: last.ckpt holds step 4, mid-epoch.
  extras.callbacks = fmt::format("[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = 6\nmarker = \"{}\"\n",
                                 (work / "killed").string());
  const auto killed = fit_checkpointed(work, plugins, kTp2, 2, 2, extras, /*must_succeed=*/false);
  INFO(killed.output);
  REQUIRE(killed.exit_code == -SIGKILL);
  const auto resumed = fit_checkpointed(work, plugins, kTp2, 2, 2, extras);
  CHECK(fulgur::test::contains(resumed.output, "global step 4, 4 batches into the epoch"));
  // The weights, Muon's momenta and the biases' AdamW moments (+ the archive: see below).
  const fulgur::dcp::Reader a((reference / "ckpt" / "last.ckpt").string()), b((work / "ckpt" / "last.ckpt").string());
  int64_t compared = 0;
  for (const std::string& key : a.keys()) {
    if (!(key.starts_with("state_dict.") || key.starts_with("optimizer_states.")) || !a.is_tensor(key)) continue;
    // The archive keeps Muon's step counts and the groups' options under the parameters'
    // addresses, which differ from run to run.
    if (key.ends_with(".fulgur_archive")) continue;
    INFO(key);
    REQUIRE(b.contains(key));
    CHECK(at::equal(a.read(key), b.read(key)));
    ++compared;
  }
  CHECK(compared == 4 + 2 + 2 * 2);
  // LBFGS keeps a history over the whole flattened parameter vector (no per-parameter shard to
  // write) and needs a closure: refused before training, with the reason.
  const auto lbfgs = fit_checkpointed(dir / "lbfgs", plugins, kTp2, 2, 1, {"", "", "", "lbfgs"}, false);
  INFO(lbfgs.output);
  CHECK(lbfgs.exit_code != 0);
  CHECK(fulgur::test::contains(lbfgs.output, "LBFGS keeps its curvature history over the whole parameter vector"));
}

TEST_CASE(
    "model_parallel: PyTorch's parallelize_module and fully_shard load the tp 2 and dp 2 x tp 2 checkpoints, and the "
    "reverse") {
  if (std::string_view(FULGUR_TEST_PYTHON).empty()) {
    fulgur::test::skip_test("no Python with torch configured (FULGUR_PYTHON)");
    return;
  }
  TempDir dir;
  const fs::path plugins = tp_plugins(dir);
  // (dp, tp) = (1, 2) trains as one process, (2, 2) as two ddp replicas: their whole checkpoints
  // are what Python must find in the split ones.
  // The optimizer state (zero_stage 2), and the parameters too (3), sharded over dp: the same layout.
  for (const auto& [split_strategy, devices, whole_strategy, whole_devices] :
       {std::tuple<std::string, int, std::string, int>{kTp2, 2, "name = \"single_device\"", 1},
        {kTp2Dp2, 4, "name = \"ddp\"\ntimeout = 60.0", 2},
        {kTp2Dp2Zero2, 4, "name = \"ddp\"\ntimeout = 60.0", 2},
        {kTp2Dp2Zero3, 4, "name = \"ddp\"\ntimeout = 60.0", 2}}) {
    INFO(split_strategy);
    const std::string tag =
        fmt::format("{}_{}", devices,
                    split_strategy == kTp2Dp2Zero2 ? "zero2" : (split_strategy == kTp2Dp2Zero3 ? "zero3" : "plain"));
    const fs::path split = dir / ("split" + tag), whole = dir / ("whole" + tag);
    fit_checkpointed(split, plugins, split_strategy, devices, 1);
    fit_checkpointed(whole, plugins, whole_strategy, whole_devices, 1);
    const fs::path python_dir = dir / ("python" + tag), resaved = dir / "resaved";
    const auto [status, output] = fulgur::test::run_command(
        fmt::format("OMP_NUM_THREADS=1 {} {}/tests/python/tp_dcp_interop.py '{}' {} 2 '{}' '{}' {}", FULGUR_TEST_PYTHON,
                    FULGUR_TEST_SOURCE_DIR, (split / "ckpt" / "last.ckpt").string(), devices / 2,
                    (whole / "ckpt" / "last.ckpt").string(), python_dir.string(),
                    devices == 2 ? "'" + resaved.string() + "'" : ""));
    INFO(output);
    REQUIRE(status == 0);
    REQUIRE(fulgur::test::contains(output, "python-ok"));
    // And the reverse: Fulgur reads what Python's ranks wrote, every tensor equal.
    const fulgur::dcp::Reader fulgur_written((split / "ckpt" / "last.ckpt").string()),
        python_written(python_dir.string());
    for (const char* name : {"col.weight", "col.bias", "row.weight", "row.bias"})
      CHECK(at::equal(python_written.read(fmt::format("state_dict.{}", name)),
                      fulgur_written.read(fmt::format("state_dict.{}", name))));
    if (devices != 2) continue;
    // The whole training state as Python's tp 2 ranks saved it: Fulgur resumes from it under tp 2
    // exactly as from its own checkpoint.
    auto resume = [&](const std::string& name, const fs::path& from) {
      fit_checkpointed(dir / name, plugins, kTp2, 2, 2, {fmt::format("ckpt_path = \"{}\"", from.string())});
      return fulgur::test::read_csv(dir / name / "runs" / "lightning_logs" / "version_0" / "metrics.csv")
          .at("train/loss");
    };
    const auto from_python = resume("from_python", resaved);
    CHECK(from_python.size() >= 10);
    CHECK(from_python == resume("from_fulgur", split / "ckpt" / "last.ckpt"));
  }
}

TEST_CASE("model_parallel: tp 2 with async_checkpoint saves its sharded checkpoint synchronously, as without") {
  TempDir dir;
  const fs::path plugins = tp_plugins(dir);
  fit_checkpointed(dir / "sync", plugins, kTp2, 2, 1);
  // The tp layout is one collective dcp::save: the strategy does not offer fulgur.strategy.async_save/1
  // for it, so the host saves synchronously (ProcessGroupStrategy's one-file split would be wrong).
  const auto run = fit_checkpointed(dir / "async", plugins, kTp2, 2, 1, {.trainer = "async_checkpoint = true"});
  INFO(run.output);
  FULGUR_CHECK_CONTAINS(run.output, "saves its checkpoints synchronously");
  const fs::path async = dir / "async" / "ckpt" / "last.ckpt", sync = dir / "sync" / "ckpt" / "last.ckpt";
  REQUIRE(fulgur::dcp::is_distributed_checkpoint(async.string()));
  const fulgur::dcp::Reader a(async.string()), s(sync.string());
  const c10::IValue whole = a.read_all();
  int compared = 0;
  for (const auto& entry : whole.toGenericDict().at("state_dict").toGenericDict()) {
    INFO(entry.key().toStringRef());
    CHECK(at::equal(entry.value().toTensor(), s.read("state_dict." + entry.key().toStringRef())));
    ++compared;
  }
  CHECK(compared > 0);
}
