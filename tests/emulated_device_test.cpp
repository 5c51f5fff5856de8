// The emulated accelerator (examples/emulated_device): a PrivateUse1 device over host memory that
// exercises every non-CPU path of the engine on a CPU-only machine. Every test drives the shipped
// `fulgur` (or the multi-process worker) from TOML in real processes, with `accelerator =
// "emulated"` and no other change, and compares with the same run on the CPU:
//   - Fashion-MNIST trains and tests, to the CPU run's accuracy;
//   - a SIGKILL mid-run resumed with ckpt_path = "last" ends bitwise equal to the uninterrupted run,
//     dropout included (the device generator's state is in the checkpoint);
//   - predict returns its outputs on the CPU, and return_predictions = false collects none;
//   - activation checkpointing redraws the same dropout mask from the device generator;
//   - ddp on 2 Gloo ranks and fsdp ZeRO-3 train like the CPU (collectives staged through host memory).
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/serialize.h>

#include <ATen/ops/equal.h>
#include <c10/core/DeviceType.h>

#include <csignal>
#include <fstream>
#include <map>
#include <string>

#include "training_job.h"

namespace {

using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;
namespace fs = std::filesystem;
namespace job = fulgur::test::job;

const fs::path kFashionMnist = "/usr/share/datasets/fashion-mnist";

bool have_fashion_mnist() {
  if (fs::exists(kFashionMnist / "t10k-images-idx3-ubyte.gz")) return true;
  fulgur::test::skip_test("Fashion-MNIST is missing: install the Debian package dataset-fashion-mnist");
  return false;
}

// Fashion-MNIST's CNN (with dropout) for `batches` training batches of 32 on `accelerator`, a
// checkpoint every 2 steps (all kept) and last.ckpt, in `root`; `trainer_extra` goes into
// [trainer], `extra` at the end.
std::string fashion_toml(const fs::path& root, const std::string& accelerator, int batches,
                         const std::string& trainer_extra = "", const std::string& extra = "") {
  return fmt::format(R"([trainer]
accelerator = "{1}"
strategy = "single_device"
devices = 1
max_epochs = 1
limit_train_batches = {2}
limit_val_batches = 2
limit_test_batches = 30
limit_predict_batches = 3
num_sanity_val_steps = 0
seed = 7
enable_progress_bar = false
enable_model_summary = false
default_root_dir = "{0}/runs"
{3}
[model]
name = "fashion_mnist_cnn"
lr = 2e-3
[data]
name = "fashion_mnist"
dir = "{4}"
batch_size = 32
num_workers = 0
val_split = 5000
seed = 7
[[callbacks]]
name = "model_checkpoint"
dirpath = "{0}/ckpt"
every_n_train_steps = 2
save_top_k = -1
save_last = true
{5}
)",
                     root.string(), accelerator, batches, trainer_extra, kFashionMnist.string(), extra);
}

ProcessRun fulgur_run(const fs::path& dir, std::vector<std::string> args) {
  args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
  return fulgur::test::run_process(args, {{"FULGUR_LOG_LEVEL", "info"}, {"OMP_NUM_THREADS", "2"}}, dir);
}

// "  test/acc    0.8125" in `fulgur test`'s output.
double printed_metric(const std::string& output, const std::string& name) {
  const size_t at = output.find("  " + name + " ");
  REQUIRE_MESSAGE(at != std::string::npos, "no " << name << " in:\n" << output);
  return std::stod(output.substr(at + name.size() + 2));
}

// A checkpoint written on the emulated device. Its storages' locations read "emu:0", and
// LibTorch's unpickler parses a location before it applies map_location (Python's torch.load
// with map_location="cpu" does not): the device's name must be known to this process, as
// "cuda:0" is. The name alone: no tensor is placed on the device.
c10::impl::GenericDict checkpoint(const fs::path& ckpt) {
  c10::register_privateuse1_backend("emu");
  return job::checkpoint_dict(ckpt);
}

bool same_weights(const fs::path& a, const fs::path& b) {
  c10::register_privateuse1_backend("emu");
  return job::same_weights(a, b);
}

c10::impl::GenericDict fit_loop_state(const fs::path& ckpt) {
  return checkpoint(ckpt).at("loops").toGenericDict().at("fit_loop").toGenericDict();
}

}  // namespace

TEST_CASE("emulated device: Fashion-MNIST trains and tests from TOML, to the CPU run's accuracy") {
  if (!have_fashion_mnist()) return;
  TempDir dir;
  std::map<std::string, double> accuracy;
  for (const std::string accelerator : {"emulated", "cpu"}) {
    CAPTURE(accelerator);
    const fs::path root = dir.subdir(accelerator);
    std::ofstream(root / "job.toml") << fashion_toml(root, accelerator, 60, "",
                                                     "[[callbacks]]\nname = \"device_stats\"\n");
    const ProcessRun fit = fulgur_run(root, {"fit", "--config", (root / "job.toml").string()});
    INFO(fit.output);
    REQUIRE(fit.exit_code == 0);
    const ProcessRun test = fulgur_run(root, {"test", "--config", (root / "job.toml").string(), "--ckpt_path=last"});
    INFO(test.output);
    REQUIRE(test.exit_code == 0);
    accuracy[accelerator] = printed_metric(test.output, "test/acc");
    // The run was on the device: its checkpoint holds that device's generator state.
    const auto fit_loop = fit_loop_state(root / "ckpt" / "last.ckpt");
    if (accelerator == "emulated") {
      REQUIRE(fit_loop.contains("device_rng_device_type"));
      CHECK(fit_loop.at("device_rng_device_type").toStringRef() == "emu");
      // device_stats logged the device allocator's counters.
      const auto csv = fulgur::test::read_csv(root / "runs" / "lightning_logs" / "version_0" / "metrics.csv");
      bool allocated = false;
      for (const auto& [column, cells] : csv)
        if (contains(column, "allocated_bytes.all.peak"))
          for (const auto& cell : cells) allocated = allocated || (!cell.empty() && std::stod(cell) > 0);
      CHECK_MESSAGE(allocated, "no device allocation was logged by device_stats");
    } else {
      CHECK_FALSE(fit_loop.contains("device_rng_state"));
    }
  }
  MESSAGE(fmt::format("Fashion-MNIST CNN, 60 batches of 32, test on 960 images: emulated {:.4f}, cpu {:.4f}",
                      accuracy["emulated"], accuracy["cpu"]));
  CHECK(accuracy["emulated"] > 0.6);
  CHECK(std::abs(accuracy["emulated"] - accuracy["cpu"]) < 0.04);  // dropout draws from other generators
}

TEST_CASE("emulated device: a SIGKILL mid-run resumes bitwise, dropout included (device RNG in the checkpoint)") {
  if (!have_fashion_mnist()) return;
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"kill-at-step"});
  const std::string plugin_paths = "[plugins]\npaths = [\"" + plugins.string() + "\"]\n";
  constexpr int kBatches = 12;

  const fs::path ref = dir.subdir("reference");
  std::ofstream(ref / "job.toml") << fashion_toml(ref, "emulated", kBatches, "", plugin_paths);
  const ProcessRun reference = fulgur_run(ref, {"fit", "--config", (ref / "job.toml").string()});
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);

  // Killed after step 7 (last.ckpt holds step 6), then started again with ckpt_path = "last".
  const fs::path work = dir.subdir("work");
  const std::string kill = fmt::format("[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = 7\nmarker = \"{}\"\n",
                                       (work / "killed").string());
  std::ofstream(work / "job.toml") << fashion_toml(work, "emulated", kBatches, "ckpt_path = \"last\"\n",
                                                   plugin_paths + kill);
  const ProcessRun killed = fulgur_run(work, {"fit", "--config", (work / "job.toml").string()});
  INFO(killed.output);
  REQUIRE(killed.exit_code == -SIGKILL);
  REQUIRE(checkpoint(work / "ckpt" / "last.ckpt").at("global_step").toInt() == 6);
  // The device generator's state is saved next to the CPU's.
  const auto saved = fit_loop_state(work / "ckpt" / "last.ckpt");
  REQUIRE(saved.contains("device_rng_state"));
  CHECK(saved.at("device_rng_device_type").toStringRef() == "emu");

  const ProcessRun resumed = fulgur_run(work, {"fit", "--config", (work / "job.toml").string()});
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.output, "Restored training state from"));
  CHECK(checkpoint(work / "ckpt" / "last.ckpt").at("global_step").toInt() == kBatches);
  // Every later checkpoint, and the final weights, bit for bit.
  for (int step : {8, 10, 12}) {
    CAPTURE(step);
    const std::string name = fmt::format("epoch=0-step={}.ckpt", step);
    REQUIRE(fs::exists(ref / "ckpt" / name));
    CHECK(same_weights(work / "ckpt" / name, ref / "ckpt" / name));
  }
  CHECK(same_weights(work / "ckpt" / "last.ckpt", ref / "ckpt" / "last.ckpt"));

  // The control: resumed from the reference's step-6 checkpoint without the device generator's
  // state, the dropout masks of steps 7..12 differ, and so do the weights.
  const auto stripped = checkpoint(ref / "ckpt" / "epoch=0-step=6.ckpt");
  auto fit_loop = stripped.at("loops").toGenericDict().at("fit_loop").toGenericDict();
  (void)fit_loop.erase("device_rng_state");
  (void)fit_loop.erase("device_rng_device_type");
  const fs::path control = dir.subdir("control");
  fulgur::write_checkpoint_file(stripped, (control / "stripped.ckpt").string());
  std::ofstream(control / "job.toml") << fashion_toml(
      control, "emulated", kBatches, "ckpt_path = \"" + (control / "stripped.ckpt").string() + "\"\n", plugin_paths);
  const ProcessRun without = fulgur_run(control, {"fit", "--config", (control / "job.toml").string()});
  INFO(without.output);
  REQUIRE(without.exit_code == 0);
  CHECK_FALSE(same_weights(control / "ckpt" / "last.ckpt", ref / "ckpt" / "last.ckpt"));
}

TEST_CASE("emulated device: predict returns outputs on the CPU, and return_predictions = false collects none") {
  if (!have_fashion_mnist()) return;
  TempDir dir;
  std::ofstream(dir / "job.toml") << fashion_toml(dir.path(), "emulated", 2);
  const ProcessRun fit = fulgur_run(dir.path(), {"fit", "--config", (dir / "job.toml").string()});
  INFO(fit.output);
  REQUIRE(fit.exit_code == 0);

  // A checkpoint file named on the command line: read once the accelerator has registered "emu".
  const std::string ckpt = "--ckpt_path=" + (dir / "ckpt" / "last.ckpt").string();
  const ProcessRun predict = fulgur_run(dir.path(), {"predict", "--config", (dir / "job.toml").string(), ckpt});
  INFO(predict.output);
  REQUIRE(predict.exit_code == 0);
  CHECK(contains(predict.output, "predict: 3 batches on cpu\n"));

  // A writer-only run: the batches reach the prediction_writer, none is collected.
  std::ofstream(dir / "writer.toml") << fashion_toml(
      dir.path(), "emulated", 2, "return_predictions = false\n",
      fmt::format("[[callbacks]]\nname = \"prediction_writer\"\noutput_dir = \"{}\"\nformat = \"csv\"\n",
                  (dir / "written").string()));
  const ProcessRun writer = fulgur_run(dir.path(), {"predict", "--config", (dir / "writer.toml").string(), ckpt});
  INFO(writer.output);
  REQUIRE(writer.exit_code == 0);
  CHECK(contains(writer.output, "predict: 0 batches\n"));
  CHECK(job::files_in(dir / "written").size() == 3);
}

// ---- the multi-process worker (tests/ddp_worker.cpp) on the emulated device ----------------------

namespace {

struct WorkerRun {
  TempDir dir;
  ProcessRun result;
  std::vector<at::Tensor> weights(int rank) const {
    std::vector<at::Tensor> w;
    torch::load(w, (dir / fmt::format("weights_rank{}.pt", rank)).string());
    return w;
  }
};

// `strategy` "fsdp:3" is fsdp with zero_stage = 3; `devices` processes (one device each).
std::unique_ptr<WorkerRun> run_worker(const std::string& accelerator, std::string strategy, int devices,
                                      std::map<std::string, std::string> env) {
  std::string table = "\n[strategy]\ntimeout = 30.0\n";
  if (strategy.starts_with("fsdp:")) {
    table += "zero_stage = " + strategy.substr(5) + "\n";
    strategy = "fsdp";
  } else if (strategy != "ddp") {
    table.clear();
  }
  auto run = std::make_unique<WorkerRun>();
  fulgur::test::write_bytes(run->dir / "run.toml", fmt::format(R"([trainer]
accelerator = "{}"
strategy = "{}"
devices = "{}"
max_steps = 6
max_epochs = 100
seed = 7
accumulate_grad_batches = 2
num_sanity_val_steps = 0
limit_val_batches = 2
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
{}
[data]
batch_size = {}
shuffle = false
)",
                                                               accelerator, strategy, devices, table, 24 / devices));
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "FULGUR_LAUNCHER"})
    env[v] = "";
  env["OMP_NUM_THREADS"] = "1";
  run->result = fulgur::test::run_process(
      {FULGUR_TEST_DDP_WORKER, (run->dir / "run.toml").string(), run->dir.path().string()}, env, run->dir.path());
  return run;
}

// The largest absolute difference between two runs' weights (0: bitwise equal).
double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

#define REQUIRE_WORKER(run) REQUIRE_MESSAGE((run)->result.exit_code == 0, (run)->result.output)

}  // namespace

TEST_CASE("emulated device: activation checkpointing recomputes dropout with the device generator's state") {
  const std::map<std::string, std::string> blocks = {{"FULGUR_TEST_BLOCKS", "1"}, {"FULGUR_TEST_DROPOUT", "1"}};
  auto checkpointed_env = blocks;
  checkpointed_env["FULGUR_TEST_CHECKPOINT"] = "1";
  auto plain = run_worker("emulated", "single_device", 1, blocks);
  REQUIRE_WORKER(plain);
  auto checkpointed = run_worker("emulated", "single_device", 1, checkpointed_env);
  REQUIRE_WORKER(checkpointed);
  // The recomputed forward drew the same mask: the same gradients, so the same weights, bit for bit.
  CHECK(max_difference(checkpointed->weights(0), plain->weights(0)) == 0);
}

TEST_CASE("emulated device: ddp on 2 Gloo ranks and fsdp ZeRO-3 train like the same runs on the CPU") {
  for (const std::string strategy : {"ddp", "fsdp:3"}) {
    CAPTURE(strategy);
    const std::map<std::string, std::string> env = {{"FULGUR_TEST_BLOCKS", "1"}};
    auto cpu = run_worker("cpu", strategy, 2, env);
    REQUIRE_WORKER(cpu);
    auto emulated = run_worker("emulated", strategy, 2, env);
    REQUIRE_WORKER(emulated);
    CHECK(contains(emulated->result.output, "rank 1: parameters on emu:1"));  // each rank on its own device
    for (int rank = 0; rank < 2; ++rank) {
      CAPTURE(rank);
      CHECK(max_difference(emulated->weights(rank), cpu->weights(rank)) == 0);
    }
  }
}
