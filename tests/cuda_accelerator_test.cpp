// The `cuda` accelerator (issue #12): the `devices` parser over every accepted and refused form with
// fake device counts (a pure function), the plugin as a machine without a visible GPU meets it, and
// the shipped example refusing accelerator = "cuda" there in one line, before writing anything.
// The GPU tests (TEST_SUITE "gpu", names starting "gpu: ") skip at runtime when no device is visible
// (CTest reports them as Skipped); scripts/gpu_check.sh runs them on a GPU machine (ctest -R '^gpu: ').
#include "test_support.h"

#include <fulgur/accelerator.h>
#include <fulgur/config.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/dataset.h>
#include <fulgur/testing.h>
#include <fulgur/testing/plugin_kit.h>

#include "../plugins/accelerator/cuda/cuda_devices.h"
#include "../plugins/callback/throughput_monitor/peak_flops.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace kit = fulgur::testing;
using fulgur::cuda_accelerator::parse_cuda_devices;
using fulgur::test::contains;
using fulgur::test::error_from;
using fulgur::test::TempDir;
using Indices = std::vector<int64_t>;

std::string refusal(std::string_view spec, int64_t count, const char* visible = nullptr) {
  const fulgur::Error e = error_from([&] { parse_cuda_devices(spec, count, visible); });
  CHECK(e.kind() == fulgur::ErrorKind::config);
  const std::string text = e.what();
  CHECK_MESSAGE(text.find('\n') == std::string::npos, "one line: " << text);
  FULGUR_CHECK_CONTAINS(text, "accelerator 'cuda'");
  return text;
}

std::shared_ptr<fulgur::Accelerator> cuda_plugin(
    std::vector<std::pair<std::string, fulgur::OptionValue>> options = {}) {
  return kit::create_plugin<fulgur::Accelerator>(fulgur::PluginKind::accelerator, "cuda", options);
}

// Lightning's fashion_mnist job, small, with the given [trainer] lines.
fs::path write_job(const TempDir& dir, const std::string& trainer_extra) {
  const fs::path toml = dir.path() / "job.toml";
  std::ofstream(toml) << "[trainer]\nmax_epochs = 1\nseed = 7\nlimit_train_batches = 20\nlimit_val_batches = 3\n"
                         "limit_test_batches = 2\nlog_every_n_steps = 5\nenable_progress_bar = false\n"
                         "default_root_dir = \""
                      << (dir.path() / "runs").string() << "\"\n"
                      << trainer_extra << "[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\nnum_workers = 2\n";
  return toml;
}

// The example under fsdp ZeRO-2 with offload_optimizer on one device: the run's output.
fulgur::test::ProcessRun run_offloaded_example(const TempDir& dir, const std::string& accelerator) {
  const fs::path toml = write_job(dir, "accelerator = \"" + accelerator + "\"\ndevices = 1\nstrategy = \"fsdp\"\n");
  std::ofstream(toml, std::ios::app) << "[strategy]\nzero_stage = 2\noffload_optimizer = true\n";
  return fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                   {{"FULGUR_LOG_LEVEL", "debug"}}, dir.path());
}

}  // namespace

TEST_CASE("cuda devices: every accepted form selects the indices Lightning selects") {
  CHECK(parse_cuda_devices("auto", 1) == Indices{0});
  CHECK(parse_cuda_devices("auto", 4) == Indices{0, 1, 2, 3});
  CHECK(parse_cuda_devices("-1", 2) == Indices{0, 1});
  CHECK(parse_cuda_devices("", 2) == Indices{0, 1});
  CHECK(parse_cuda_devices(" auto ", 2) == Indices{0, 1});
  CHECK(parse_cuda_devices("1", 8) == Indices{0});  // a count: the first N
  CHECK(parse_cuda_devices("2", 2) == Indices{0, 1});
  CHECK(parse_cuda_devices("3", 8) == Indices{0, 1, 2});
  CHECK(parse_cuda_devices("0,1", 2) == Indices{0, 1});
  CHECK(parse_cuda_devices("0, 2", 4) == Indices{0, 2});
  CHECK(parse_cuda_devices("2,0", 4) == Indices{2, 0});  // in the order given
  CHECK(parse_cuda_devices("1,", 2) == Indices{1});      // Lightning: "1," is index 1, not a count
  CHECK(parse_cuda_devices("[0, 2]", 4) == Indices{0, 2});
  CHECK(parse_cuda_devices("[3]", 4) == Indices{3});  // TOML devices = [3] arrives as "[3]"
  CHECK(parse_cuda_devices("[ 1 ,3 ]", 4) == Indices{1, 3});
}

TEST_CASE("cuda devices: malformed specs, indices beyond the count and no device are refused in one line") {
  for (const char* bad :
       {"abc", "1.5", "gpu", "0,,1", ",", ",1", "[0, 2", "0 2", "[]", "[a]", "0,-1", "two", "1e2", "0x1", "auto,1"}) {
    INFO("spec " << bad);
    const std::string text = refusal(bad, 4);
    FULGUR_CHECK_CONTAINS(text, "is not understood");
    FULGUR_CHECK_CONTAINS(text, "\"0,1\"");  // says what to write instead
  }
  FULGUR_CHECK_CONTAINS(refusal("0", 4), "devices = 0 selects no device");
  FULGUR_CHECK_CONTAINS(refusal("-2", 4), "selects no device");
  const std::string many = refusal("4", 2);
  FULGUR_CHECK_CONTAINS(many, "asks for 4 devices, but only 2 are visible");
  FULGUR_CHECK_CONTAINS(many, "CUDA_VISIBLE_DEVICES");
  FULGUR_CHECK_CONTAINS(refusal("0,2", 2), "names device 2, but only 2 are visible (indices 0..1)");
  FULGUR_CHECK_CONTAINS(refusal("[1]", 1), "names device 1, but only 1 is visible");
  FULGUR_CHECK_CONTAINS(refusal("0,0", 2), "names device 0 twice");
  for (const char* spec : {"auto", "1", "0,1", "-1"}) {
    INFO("spec " << spec);
    const std::string none = refusal(spec, 0, nullptr);
    FULGUR_CHECK_CONTAINS(none, "no CUDA device is visible (torch sees 0; CUDA_VISIBLE_DEVICES=<unset>)");
    FULGUR_CHECK_CONTAINS(none, "use accelerator = \"cpu\" or run on a GPU machine");
  }
  FULGUR_CHECK_CONTAINS(refusal("auto", 0, ""), "CUDA_VISIBLE_DEVICES=\"\"");
  FULGUR_CHECK_CONTAINS(refusal("auto", 0, "3"), "CUDA_VISIBLE_DEVICES=\"3\"");
}

TEST_CASE("cuda devices: TOML devices = [0, 2] and devices = [1] reach the accelerator as index lists") {
  const fulgur::Config two = fulgur::parse_config("[trainer]\ndevices = [0, 2]\n", "/cfg/run.toml");
  CHECK(two.trainer.get_string("devices") == "0,2");
  const fulgur::Config one = fulgur::parse_config("[trainer]\ndevices = [1]\n", "/cfg/run.toml");
  CHECK(one.trainer.get_string("devices") == "[1]");
  CHECK(parse_cuda_devices(one.trainer.get_string("devices"), 2) == Indices{1});
  const fulgur::Error strings =
      error_from([] { fulgur::parse_config("[trainer]\ndevices = [\"a\"]\n", "/cfg/run.toml"); });
  FULGUR_CHECK_CONTAINS(strings.what(), "devices");
}

TEST_CASE("cuda accelerator: options that it cannot act on are refused, the rest are declared") {
  const fulgur::Error precision = error_from([] { cuda_plugin({{"float32_matmul_precision", std::string("low")}}); });
  FULGUR_CHECK_CONTAINS(precision.what(), "float32_matmul_precision = \"low\" is not a precision");
  const std::runtime_error unknown = [] {
    try {
      cuda_plugin({{"deterministic", true}});
    } catch (const std::runtime_error& e) {
      return e;
    }
    return std::runtime_error("no error");
  }();
  FULGUR_CHECK_CONTAINS(unknown.what(), "has no option 'deterministic'");
  const auto accelerator = cuda_plugin({{"benchmark", true}, {"float32_matmul_precision", std::string("high")}});
  CHECK(accelerator->device_type() == c10::DeviceType::CUDA);
  CHECK(accelerator->default_collective_backend() == "nccl");
}

TEST_CASE("cuda accelerator: without a visible device it is unavailable and refuses in one line") {
  const auto accelerator = cuda_plugin();
  if (accelerator->device_count() > 0) {
    fulgur::test::skip_test("this machine has a visible CUDA device");
    return;
  }
  CHECK_FALSE(accelerator->is_available());
  CHECK(accelerator->device_count() == 0);
  for (const char* spec : {"auto", "1", "0,1"}) {
    const fulgur::Error e = error_from([&] { accelerator->parse_devices(spec); });
    FULGUR_CHECK_CONTAINS(e.what(), "accelerator 'cuda': no CUDA device is visible (torch sees 0;");
  }
  const fulgur::Error setup = error_from([&] { accelerator->setup_device(c10::Device(c10::DeviceType::CUDA, 0)); });
  FULGUR_CHECK_CONTAINS(setup.what(), "no CUDA device is visible");
  FULGUR_CHECK_CONTAINS(setup.what(), "use accelerator = \"cpu\" or run on a GPU machine");
  CHECK(std::string(setup.what()).find('\n') == std::string::npos);
  // Nothing to wait for and nothing to report; neither touches a device.
  CHECK_NOTHROW(accelerator->synchronize(c10::Device(c10::DeviceType::CUDA, 0)));
  CHECK(accelerator->device_stats(c10::Device(c10::DeviceType::CUDA, 0)).empty());
}

TEST_CASE("cuda accelerator: the example refuses accelerator = \"cuda\" without a GPU and writes nothing") {
  if (cuda_plugin()->device_count() > 0) {
    fulgur::test::skip_test("this machine has a visible CUDA device");
    return;
  }
  TempDir dir;
  const fs::path toml = write_job(dir, "accelerator = \"cuda\"\ndevices = \"auto\"\n");
  const auto run = fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                             {{"FULGUR_LOG_LEVEL", "info"}}, dir.path());
  INFO(run.output);
  CHECK(run.exit_code != 0);
  FULGUR_CHECK_CONTAINS(run.output, "accelerator 'cuda': no CUDA device is visible (torch sees 0;");
  FULGUR_CHECK_CONTAINS(run.output, "use accelerator = \"cpu\" or run on a GPU machine");
  // The refusal is one line of the output, not a stack of them.
  size_t lines_with_refusal = 0, at = 0;
  while ((at = run.output.find("no CUDA device is visible", at)) != std::string::npos) ++lines_with_refusal, ++at;
  CHECK(lines_with_refusal == 1);
  CHECK_FALSE(fs::exists(dir.path() / "runs"));
  CHECK_FALSE(fs::exists(dir.path() / "lightning_logs"));
  CHECK_FALSE(fs::exists(dir.path() / "checkpoints"));
}

TEST_CASE("accelerator = \"auto\" trains on cuda when a GPU is visible, else on cpu, and takes no options") {
  const bool gpu = cuda_plugin()->device_count() > 0;
  TempDir dir;
  const fs::path toml = write_job(dir, "accelerator = \"auto\"\ndevices = 1\n");
  const auto run = fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                             {{"FULGUR_LOG_LEVEL", "info"}}, dir.path());
  INFO(run.output);
  CHECK(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output,
                        gpu ? "accelerator = \"auto\": using 'cuda'" : "accelerator = \"auto\": using 'cpu'");
  bool checkpoint = false;
  for (const auto& e : fs::recursive_directory_iterator(dir.path() / "runs"))
    checkpoint |= e.path().extension() == ".ckpt";
  CHECK(checkpoint);

  // Options belong to one accelerator: with "auto" they are refused before anything runs.
  TempDir other;
  std::ofstream(write_job(other, "accelerator = \"auto\"\n"), std::ios::app) << "[accelerator]\nthreads = 1\n";
  const auto refused = fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", (other / "job.toml").string()},
                                                 {}, other.path());
  INFO(refused.output);
  CHECK(refused.exit_code != 0);
  FULGUR_CHECK_CONTAINS(refused.output, "accelerator = \"auto\" takes no [accelerator] options");
  CHECK_FALSE(fs::exists(other.path() / "runs"));
}

#ifdef FULGUR_TEST_CUDA_HOOKS_REPORT
// ATen resolves its CUDA hooks once per process, at the first device query; a query before the
// cuda accelerator loads libtorch_cuda fixes the CPU-only stub and CUDA is off for the whole run.
// Fulgur's own programs link libtorch_cpu only, so the order (validate and load the accelerator,
// then seed) is all that keeps CUDA on. Every entry point runs in its own process, seeded, with a
// library preloaded that reports the hooks when the process ends.
TEST_CASE(
    "cuda hooks: fulgur fit, Trainer::from_toml, cli_main and ConfigBuilder, seeded, with accelerator = \"cuda\" "
    "or \"auto\", end with ATen's real CUDA hooks") {
  const bool gpu = cuda_plugin()->device_count() > 0;
  const std::string trainer_lines =
      "max_epochs = 1\nseed = 7\nlimit_train_batches = 2\nlimit_val_batches = 0\nlimit_test_batches = 1\n"
      "enable_progress_bar = false\nenable_checkpointing = false\ndevices = 1\n";
  const std::map<std::string, std::string> env = {{"LD_PRELOAD", FULGUR_TEST_CUDA_HOOKS_REPORT},
                                                  {"FULGUR_LOG_LEVEL", "warn"}};
  for (const std::string accelerator : {"cuda", "auto"}) {
    TempDir dir;
    const std::string trainer = "[trainer]\naccelerator = \"" + accelerator + "\"\n" + trainer_lines +
                                "default_root_dir = \"" + (dir / "runs").string() + "\"\n";
    std::ofstream(dir / "plugins.toml") << trainer
                                        << "[model]\nname = \"fashion_mnist_mlp\"\n[data]\nname = \"fashion_mnist\"\n"
                                           "batch_size = 32\n";
    std::ofstream(dir / "program.toml") << trainer << "[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\n";
    std::ofstream(dir / "cli.toml") << trainer << "[data]\nbatch_size = 32\n";
    const std::vector<std::pair<std::string, std::vector<std::string>>> entry_points = {
        {"fulgur fit", {FULGUR_TEST_FULGUR_BIN, "fit", "--config", (dir / "plugins.toml").string()}},
        {"Trainer::from_toml", {FULGUR_TEST_FASHION_MNIST, "--config", (dir / "program.toml").string()}},
        {"cli_main", {FULGUR_TEST_FASHION_MNIST_CLI, "fit", "--config", (dir / "cli.toml").string()}},
        {"ConfigBuilder", {FULGUR_TEST_CUDA_HOOKS_PROBE, accelerator, (dir / "runs").string()}},
    };
    for (const auto& [entry_point, args] : entry_points) {
      CAPTURE(entry_point);
      CAPTURE(accelerator);
      const auto run = fulgur::test::run_process(args, env, dir.path());
      INFO(run.output);
      FULGUR_CHECK_CONTAINS(run.output, "FULGUR_CUDA_HOOKS: real (CUDA runtime ");
      if (accelerator == "cuda" && !gpu) {
        CHECK(run.exit_code != 0);
        FULGUR_CHECK_CONTAINS(run.output, "accelerator 'cuda': no CUDA device is visible");
      } else {
        CHECK(run.exit_code == 0);
      }
    }
  }

  // The reordering the test above guards against, done on purpose: a seed before the Trainer
  // exists. The hooks are the stub, and the cuda accelerator refuses in one line instead of
  // training with CUDA half off.
  TempDir dir;
  const auto seeded_first = fulgur::test::run_process(
      {FULGUR_TEST_CUDA_HOOKS_PROBE, "cuda", (dir / "runs").string(), "--seed-first"}, env, dir.path());
  INFO(seeded_first.output);
  CHECK(seeded_first.exit_code != 0);
  FULGUR_CHECK_CONTAINS(seeded_first.output, "FULGUR_CUDA_HOOKS: stub");
  FULGUR_CHECK_CONTAINS(seeded_first.output,
                        "accelerator 'cuda': ATen's CUDA hooks were resolved before libtorch_cuda was loaded");
}
#endif

TEST_CASE("fsdp offload_optimizer on cpu: the example trains, with a warning that it only adds copies there") {
  TempDir dir;
  const auto run = run_offloaded_example(dir, "cpu");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, "offload_optimizer = true on cpu: the parameters already live in host memory");
  FULGUR_CHECK_CONTAINS(run.output, "rank 0 steps its rows in host memory (offload_optimizer): 814120 bytes");
}

TEST_CASE("throughput_monitor: MFU against the peak FLOP/s table, by device name and compute dtype") {
  using fulgur::throughput::peak_flops_for;
  // Specific names before the general ones: PCIe, NVL and L40S are not the SXM, H100 and L40 rows.
  CHECK(peak_flops_for("NVIDIA H200", at::kBFloat16, false) == 989.4e12);
  CHECK(peak_flops_for("NVIDIA H200 NVL", at::kBFloat16, false) == 835.5e12);
  CHECK(peak_flops_for("NVIDIA H100 80GB HBM3", at::kHalf, false) == 989.4e12);
  CHECK(peak_flops_for("NVIDIA H100 PCIe", at::kBFloat16, false) == 756e12);
  CHECK(peak_flops_for("NVIDIA L40S", at::kBFloat16, false) == 362.05e12);
  CHECK(peak_flops_for("NVIDIA A100-SXM4-80GB", at::kFloat, false) == 19.5e12);
  CHECK(peak_flops_for("NVIDIA A100-SXM4-80GB", at::kFloat, true) == 156e12);
  CHECK_FALSE(peak_flops_for("Tesla T4", at::kBFloat16, false).has_value());
  CHECK_FALSE(peak_flops_for("NVIDIA L4", at::kDouble, false).has_value());  // not published
  CHECK_FALSE(peak_flops_for("cpu", at::kFloat, false).has_value());

  // The callback, driven by the testing kit: MFU = samples/s x FLOPs per sample / the row's peak.
  auto logged_row = [](const std::string& device, c10::ScalarType dtype, double peak_option) {
    kit::FakeTrainer trainer;
    trainer.device_name_value = device;
    trainer.compute_dtype_value = dtype;
    auto monitor = kit::create_plugin<fulgur::Callback>(
        fulgur::PluginKind::callback, "throughput_monitor",
        {{"flops_per_sample", 1e9}, {"peak_flops", peak_option}, {"count_flops", false}});
    trainer.start_fit(*monitor);
    monitor->on_train_start(trainer);
    fulgur::Batch batch;
    batch.input = at::ones({4, 3});
    for (int64_t i = 0; i < 3; ++i) monitor->on_train_batch_end(trainer, {}, batch, i);
    REQUIRE_FALSE(trainer.logged.empty());
    return trainer.logged.back().metrics;
  };
  const fulgur::MetricMap h200 = logged_row("NVIDIA H200", at::kBFloat16, 0.0);
  REQUIRE(h200.count("train/mfu") == 1);
  CHECK(h200.at("train/mfu") == doctest::Approx(h200.at("train/device/samples_per_sec") * 1e9 / 989.4e12));
  const fulgur::MetricMap given = logged_row("NVIDIA H200", at::kBFloat16, 1e12);  // the option wins
  CHECK(given.at("train/mfu") == doctest::Approx(given.at("train/device/samples_per_sec") * 1e9 / 1e12));
  CHECK(logged_row("cpu", at::kFloat, 0.0).count("train/mfu") == 0);  // unknown device: no MFU
}

namespace {
// The gpu: tests' preamble: true, and the test reported as skipped, when no CUDA device is visible.
bool skip_without_device(bool visible) {
  if (!visible) fulgur::test::skip_test("no CUDA device is visible");
  return !visible;
}
}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("gpu: set_device, allocator statistics, synchronize and the TF32 option on a visible device") {
    const auto accelerator = cuda_plugin({{"float32_matmul_precision", std::string("high")}});
    if (skip_without_device(accelerator->device_count() > 0)) return;
    const std::vector<c10::Device> devices = accelerator->parse_devices("auto");
    REQUIRE(static_cast<int64_t>(devices.size()) == accelerator->device_count());
    const c10::Device last = devices.back();
    accelerator->setup_device(last);
    CHECK(at::globalContext().float32MatmulPrecision() == at::Float32MatmulPrecision::HIGH);
    const at::Tensor x = at::ones({1024, 1024}, at::TensorOptions().device(last));
    accelerator->synchronize(last);
    const fulgur::MetricMap stats = accelerator->device_stats(last);
    REQUIRE(stats.count("allocated_bytes.all.current") == 1);
    CHECK(stats.at("allocated_bytes.all.current") >= 4.0 * 1024 * 1024);
    CHECK(stats.at("reserved_bytes.all.current") >= stats.at("allocated_bytes.all.current"));
    CHECK(stats.at("num_ooms") == 0);
    CHECK(stats.count("num_alloc_retries") == 1);
    CHECK(x.device() == last);
    const fulgur::Error beyond =
        error_from([&] { accelerator->parse_devices(std::to_string(accelerator->device_count()) + ","); });
    FULGUR_CHECK_CONTAINS(beyond.what(), "names device");
  }

  TEST_CASE("gpu: DataLoader pin_memory hands out pinned batches that copy to the device asynchronously") {
    // The plugin first: loading it loads libtorch_cuda, without which torch sees no CUDA at all.
    if (skip_without_device(cuda_plugin({})->device_count() > 0 && at::globalContext().hasCUDA())) return;
    struct Squares final : fulgur::data::Dataset {
      int64_t size() const override { return 40; }
      fulgur::data::Sample get(int64_t i) const override {
        fulgur::data::Sample s;
        s.input = at::full({3}, static_cast<double>(i * i), at::kFloat);
        s.target = at::scalar_tensor(i, at::kLong);
        return s;
      }
    };
    for (const bool pin : {false, true}) {
      INFO("pin_memory = " << pin);
      auto loader = fulgur::data::make_data_loader(
          std::make_shared<Squares>(), fulgur::data::DataLoaderOptions().batch_size(8).num_workers(2).pin_memory(pin));
      loader->start_epoch(0);
      int64_t batches = 0;
      while (auto batch = loader->next()) {
        CHECK(batch->input.is_pinned() == pin);
        CHECK(batch->target.is_pinned() == pin);
        const at::Tensor on_device = batch->input.to(at::Device(at::kCUDA, 0), /*non_blocking=*/true);
        CHECK(at::equal(on_device.cpu(), batch->input));
        ++batches;
      }
      CHECK(batches == 5);
    }
  }

  TEST_CASE("gpu: fsdp offload_optimizer keeps the optimizer's rows in pinned host memory and trains the example") {
    if (skip_without_device(cuda_plugin()->device_count() > 0)) return;
    TempDir dir;
    const auto run = run_offloaded_example(dir, "cuda");
    INFO(run.output);
    CHECK(run.exit_code == 0);
    FULGUR_CHECK_CONTAINS(run.output,
                          "steps its rows in host memory (offload_optimizer): 814120 bytes of "
                          "parameters, a copy apart from the model's on cuda:0");
    CHECK_FALSE(fulgur::test::contains(run.output, "saves nothing"));
  }

  TEST_CASE("gpu: a StepGraph records kernels, replays them, and refuses a step that waits for the host") {
    const auto accelerator = cuda_plugin();
    if (skip_without_device(accelerator->device_count() > 0)) return;
    const c10::Device device(c10::DeviceType::CUDA, 0);
    accelerator->setup_device(device);
    CHECK(fulgur::test::contains(accelerator->device_name(device), "NVIDIA"));
    at::Tensor counter = at::zeros({4}, at::TensorOptions().device(device));
    auto* graphs = fulgur::find_extension<fulgur::StepGraphFactory>(*accelerator);
    REQUIRE(graphs != nullptr);
    auto graph = graphs->make_step_graph(device);
    REQUIRE(graph != nullptr);
    graph->warm_up([&] { counter.add_(1); });
    graph->capture([&] { counter.add_(2); });  // recorded, not run
    accelerator->synchronize(device);
    CHECK(counter.sum().item<double>() == 4.0);
    graph->replay();
    graph->replay();
    CHECK(counter.sum().item<double>() == 20.0);
    auto syncing = graphs->make_step_graph(device);
    const fulgur::Error refused = error_from([&] { syncing->capture([&] { (void)counter.sum().item<double>(); }); });
    INFO(refused.what());
    CHECK(std::string(refused.what()).find('\n') == std::string::npos);
    // The device is usable after the refused capture: kernels, random numbers outside a graph (the
    // generator left capture mode), memory freed after use on another stream is reused, and a new
    // capture with random numbers draws new ones at every replay.
    counter.add_(1);
    CHECK(counter.sum().item<double>() == 24.0);
    CHECK(at::randn({8}, at::TensorOptions().device(device)).defined());
    // Staged copies are allocated on the copy stream and marked used on the current one: their
    // blocks are reused only through the allocator's stream events, which a capture left
    // "underway" would stop processing.
    const at::Tensor host = at::ones({64, 1024, 1024}, at::kFloat).pin_memory();  // 256 MiB
    auto* staging = fulgur::find_extension<fulgur::StagedTransfers>(*accelerator);
    REQUIRE(staging != nullptr);
    accelerator->synchronize(device);
    const double reserved_before = accelerator->device_stats(device).at("reserved_bytes.all.current");
    for (int i = 0; i < 20; ++i) {
      fulgur::Batch staged;
      REQUIRE(staging->stage_transfer(device, [&] { staged.input = host.to(device, /*non_blocking=*/true); }));
      staging->finish_transfer(device, staged);
      staged.input.add_(1);
    }
    accelerator->synchronize(device);
    CHECK(accelerator->device_stats(device).at("reserved_bytes.all.current") <= reserved_before + 3 * 268435456.0);
    at::Tensor noise = at::zeros({1024}, at::TensorOptions().device(device));
    auto random = graphs->make_step_graph(device);
    random->warm_up([&] { noise.copy_(at::rand({1024}, noise.options())); });
    random->capture([&] { noise.copy_(at::rand({1024}, noise.options())); });
    random->replay();
    const at::Tensor first = noise.clone();
    random->replay();
    CHECK_FALSE(at::equal(first, noise));
  }

  TEST_CASE("gpu: a staged batch copies on the copy stream and is ready on the current one after finish_transfer") {
    const auto accelerator = cuda_plugin();
    if (skip_without_device(accelerator->device_count() > 0)) return;
    const c10::Device device(c10::DeviceType::CUDA, 0);
    accelerator->setup_device(device);
    fulgur::Batch batch;
    batch.input = at::full({256, 1024}, 3.0, at::kFloat).pin_memory();
    batch.target = at::full({256}, 7, at::kLong).pin_memory();
    auto* staging = fulgur::find_extension<fulgur::StagedTransfers>(*accelerator);
    REQUIRE(staging != nullptr);
    REQUIRE(staging->stage_transfer(device, [&] {
      batch.input = batch.input.to(device, /*non_blocking=*/true);
      batch.target = batch.target.to(device, /*non_blocking=*/true);
    }));
    staging->finish_transfer(device, batch);
    CHECK(batch.input.device() == device);
    CHECK(batch.input.sum().item<double>() == 3.0 * 256 * 1024);
    CHECK(batch.target.sum().item<int64_t>() == 7 * 256);
  }

  TEST_CASE(
      "gpu: cuda_graphs = \"on\" trains the example in 32-true, bf16-mixed and 16-mixed like the uncaptured run") {
    if (skip_without_device(cuda_plugin()->device_count() > 0)) return;
    auto accuracy_of = [](const std::string& output) {
      const size_t at = output.rfind("test accuracy: ");
      REQUIRE(at != std::string::npos);
      return std::stod(output.substr(at + 15));
    };
    for (const std::string precision : {"32-true", "bf16-mixed", "16-mixed"}) {
      INFO(precision);
      double accuracy[2] = {0, 0};
      for (const bool graphs : {false, true}) {
        TempDir dir;
        const fs::path toml = write_job(dir, "accelerator = \"cuda\"\ndevices = 1\nprecision = \"" + precision +
                                                 "\"\ncuda_graphs = \"" + (graphs ? "on" : "off") + "\"\n");
        const auto run = fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                                   {{"FULGUR_LOG_LEVEL", "debug"}}, dir.path());
        INFO(run.output);
        REQUIRE(run.exit_code == 0);
        CHECK(fulgur::test::contains(run.output, "the training step was captured at batch 3") == graphs);
        // 16-mixed: float16 autocast and the skip decided on the device, captured or not.
        CHECK(fulgur::test::contains(run.output, "optimizer steps are decided on the device") ==
              (precision == "16-mixed"));
        accuracy[graphs] = accuracy_of(run.output);
      }
      CHECK(std::abs(accuracy[1] - accuracy[0]) < 3.0);  // percentage points, 20 steps of the MLP
    }
  }

  TEST_CASE("gpu: the example trains one short epoch on cuda and writes its checkpoint") {
    if (skip_without_device(cuda_plugin()->device_count() > 0)) return;
    TempDir dir;
    const fs::path toml = write_job(dir, "accelerator = \"cuda\"\ndevices = 1\n");
    const auto run = fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                               {{"FULGUR_LOG_LEVEL", "info"}}, dir.path());
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(fs::exists(dir.path() / "runs"));
  }
}
