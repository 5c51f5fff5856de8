// The observability plugins end to end: the tensorboard logger (read back with TensorBoard's own
// Python reader), the pytorch (kineto) profiler's Chrome traces and summary, and the lr_monitor,
// throughput_monitor, device_stats and timer callbacks in real fits. Also: hyperparameters reach
// every logger, and an unwritable log directory fails at setup, before any training step.
#include <fulgur/callback.h>
#include <fulgur/checkpoint_io.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/error.h>
#include <fulgur/logger.h>
#include <fulgur/module.h>
#include <fulgur/registry/registry.h>
#include <fulgur/trainer.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "test_support.h"

namespace {

using fulgur::test::error_from;
using fulgur::test::read_csv;
using fulgur::test::run_command;
using fulgur::test::TempDir;
namespace fs = std::filesystem;

// ---- fixtures -------------------------------------------------------------------------------------

// A small classifier; SGD with two parameter groups (different learning rates) so that lr_monitor
// has groups to name.
struct TinyModule : fulgur::Module {
  TinyModule() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    ++training_steps;
    auto loss = torch::nn::functional::cross_entropy(fc2->forward(torch::relu(fc1->forward(b.input))), b.target);
    log("train/loss", loss);
    return {loss};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(fc1->parameters(),
                        std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).momentum(0.9)));
    groups.emplace_back(fc2->parameters(),
                        std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.01).momentum(0.9)));
    return {
        fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.1)))};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  int64_t training_steps = 0;
};

struct TinyData : fulgur::DataModule {
  explicit TinyData(int64_t n = 64, int64_t batch = 8) : batch(batch) {
    torch::manual_seed(11);
    x = torch::randn({n, 8});
    y = torch::randint(0, 3, {n}, torch::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    return fulgur::make_tensor_loader(x, y, fulgur::TensorLoaderOptions().batch_size(batch));
  }
  int64_t batch;
  at::Tensor x, y;
};

fulgur::Config config_from(const TempDir& dir, const std::string& body) {
  const std::string text = fmt::format(R"(
[trainer]
default_root_dir = "{}"
seed = 3
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
{}
)",
                                       dir.path().string(), body);
  return fulgur::parse_config(text, dir / "test.toml");
}

// Runs `script` with the venv's Python; the script prints "python-ok" once its asserts passed.
void check_python(const TempDir& dir, const std::string& script, const std::string& args) {
  const fs::path file = dir / "check.py";
  std::ofstream(file) << script;
  const auto [status, output] = run_command(fmt::format("{} {} {}", FULGUR_TEST_PYTHON, file.string(), args));
  INFO(output);
  CHECK(status == 0);
  CHECK(fulgur::test::contains(output, "python-ok"));
}

std::vector<double> numbers(const std::vector<std::string>& cells) {
  std::vector<double> out;
  for (const auto& c : cells)
    if (!c.empty()) out.push_back(std::stod(c));
  return out;
}

fulgur::PluginRegistry& registry() {
  static fulgur::PluginRegistry instance(fulgur::plugin_search_path({}));
  return instance;
}

template <class Interface>
std::shared_ptr<Interface> create(fulgur::PluginKind kind, std::string_view name,
                                  const std::map<std::string, fulgur::OptionValue>& overrides = {}) {
  fulgur::Options options(fmt::format("{} '{}'", fulgur::to_string(kind), name));
  for (const auto& schema : registry().resolve(kind, name).metadata.options)
    if (schema.default_value) options.set(schema.key, *schema.default_value);
  for (const auto& [key, value] : overrides) options.set(key, value);
  return fulgur::plugin_cast<Interface>(registry().create(kind, name, options));
}

// The TensorBoard reader: every record's CRCs checked, then the tags, steps and values through
// EventAccumulator, as the TensorBoard UI reads them. `checks` is Python run with `ea` and `raw`.
std::string tensorboard_script(const std::string& checks) {
  return R"(
import glob, os, struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.plugins.hparams import plugin_data_pb2
run = sys.argv[1]
files = glob.glob(os.path.join(run, "events.out.tfevents.*"))
assert len(files) == 1, files
data = open(files[0], "rb").read()
at, records = 0, 0
while at < len(data):
    (length,) = struct.unpack("<Q", data[at:at + 8])
    (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
    assert length_crc == masked_crc32c(data[at:at + 8]), "length crc"
    payload = data[at + 12:at + 12 + length]
    (payload_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
    assert payload_crc == masked_crc32c(payload), "payload crc"
    at += 16 + length
    records += 1
assert at == len(data) and records > 1
ea = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
ea.Reload()
def scalars(tag):
    return [(e.step, e.value) for e in ea.Scalars(tag)]
def close(a, b):
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))
)" + checks +
         "\nprint(\"python-ok\")\n";
}

}  // namespace

// ---- tensorboard logger -----------------------------------------------------------------------------

TEST_CASE("tensorboard: scalars, text and hparams that TensorBoard's reader reads back") {
  TempDir dir;
  auto logger = create<fulgur::Logger>(fulgur::PluginKind::logger, "tensorboard", {{"max_queue", int64_t{2}}});
  fulgur::LoggerSetup setup;
  setup.root_dir = dir.path().string();
  logger->setup(setup);
  const fs::path run = dir / "lightning_logs" / "version_0";
  CHECK(logger->log_dir() == run.string());
  logger->log_hyperparams({{"model.lr", "0.001"},
                           {"model.optimizer", "\"adam\""},
                           {"trainer.deterministic", "false"},
                           {"data.sizes", "[1, 2]"}});
  for (int64_t step = 0; step < 5; ++step)
    logger->log_metrics({{"train/loss", 1.0 / (step + 1)}, {"epoch", 0.0}}, step * 10);
  logger->log_metrics({{"val/acc", 0.75}}, 49);
  logger->finalize(fulgur::RunStatus::success);
  CHECK(fs::exists(run / "hparams.yaml"));
  CHECK(fulgur::test::contains(fulgur::test::read_bytes(run / "hparams.yaml"), "model.lr: 0.001"));

  check_python(dir, tensorboard_script(R"(
tags = ea.Tags()
assert set(tags["scalars"]) == {"train/loss", "epoch", "val/acc", "hp_metric"}, tags["scalars"]
loss = scalars("train/loss")
assert [s for s, _ in loss] == [0, 10, 20, 30, 40], loss
assert all(close(v, 1.0 / (i + 1)) for i, (_, v) in enumerate(loss)), loss
assert scalars("val/acc") == [(49, 0.75)]
assert scalars("hp_metric") == [(0, -1.0)]
text = ea.Tensors("hparams")[0].tensor_proto.string_val[0].decode()
assert "| model.lr | 0.001 |" in text and '| model.optimizer | "adam" |' in text, text
content = ea.PluginTagToContent("hparams")
start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
assert start.hparams["model.lr"].number_value == 0.001
assert start.hparams["model.optimizer"].string_value == "adam"
assert start.hparams["trainer.deterministic"].bool_value is False
assert start.hparams["data.sizes"].string_value == "[1, 2]"
exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
assert sorted(h.name for h in exp.hparam_infos) == ["data.sizes", "model.lr", "model.optimizer", "trainer.deterministic"]
assert [m.name.tag for m in exp.metric_infos] == ["hp_metric"]
end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
assert end.status == 1
)"),
               run.string());
}

TEST_CASE("tensorboard: version_N directories follow the csv logger's rules and share a run with it") {
  TempDir dir;
  fulgur::LoggerSetup setup;
  setup.root_dir = dir.path().string();
  auto csv = create<fulgur::Logger>(fulgur::PluginKind::logger, "csv");
  auto tb = create<fulgur::Logger>(fulgur::PluginKind::logger, "tensorboard");
  csv->setup(setup);
  tb->setup(setup);  // csv's fresh, empty version_0 is this run's too
  CHECK(tb->log_dir() == csv->log_dir());
  CHECK(fs::path(tb->log_dir()).filename() == "version_0");
  tb->log_metrics({{"loss", 1.0}}, 0);
  tb->finalize(fulgur::RunStatus::success);

  // A version that holds a run is taken; an empty one (nothing logged yet) is not.
  auto next = create<fulgur::Logger>(fulgur::PluginKind::logger, "tensorboard");
  next->setup(setup);
  CHECK(fs::path(next->log_dir()).filename() == "version_1");
  auto named =
      create<fulgur::Logger>(fulgur::PluginKind::logger, "tensorboard",
                             {{"name", std::string("exp")}, {"version", int64_t{7}}, {"sub_dir", std::string("tb")}});
  named->setup(setup);
  CHECK(named->log_dir() == (dir / "exp" / "version_7" / "tb").string());
}

TEST_CASE("an unwritable log directory fails at setup with what, where and how to fix, before any step") {
  TempDir dir;
  const fs::path blocker = dir / "not-a-directory";
  std::ofstream(blocker) << "a file where the log directory should go";
  const std::string bad = (blocker / "logs").string();
  for (const char* logger : {"tensorboard", "csv"}) {
    CAPTURE(logger);
    fulgur::Trainer trainer(config_from(dir, fmt::format("max_steps = 3\n[[loggers]]\nname = \"{}\"\nsave_dir = "
                                                         "\"{}\"\n",
                                                         logger, bad)));
    TinyModule module;
    TinyData data;
    const fulgur::Error error = error_from([&] { trainer.fit(module, data); });
    CHECK(error.kind() == fulgur::ErrorKind::io);
    FULGUR_CHECK_CONTAINS(error.what(), bad);
    FULGUR_CHECK_CONTAINS(error.what(), "save_dir");
    CHECK(module.training_steps == 0);
  }
  fulgur::Trainer trainer(config_from(
      dir, fmt::format("max_steps = 3\nlogger = false\n[profiler]\nname = \"pytorch\"\ndirpath = \"{}\"\n", bad)));
  TinyModule module;
  TinyData data;
  const fulgur::Error error = error_from([&] { trainer.fit(module, data); });
  FULGUR_CHECK_CONTAINS(error.what(), bad);
  FULGUR_CHECK_CONTAINS(error.what(), "dirpath");
  CHECK(module.training_steps == 0);
}

// ---- a fit with every monitor ----------------------------------------------------------------------

TEST_CASE("a fit logs hyperparameters, learning rates, throughput and device stats to csv and tensorboard") {
  TempDir dir;
  fulgur::Trainer trainer(config_from(dir, R"(
max_steps = 8
log_every_n_steps = 2
[[loggers]]
name = "csv"
flush_logs_every_n_steps = 1
[[loggers]]
name = "tensorboard"
[[callbacks]]
name = "lr_monitor"
log_momentum = true
[[callbacks]]
name = "throughput_monitor"
peak_flops = 1e9
[[callbacks]]
name = "device_stats"
[model]
width = 16
[data]
batch = 8
)"));
  TinyModule module;
  module.hparams.set("set_in_code", 1.5);  // a Module's own hyperparameters win over [model]
  TinyData data;
  trainer.fit(module, data);
  REQUIRE(trainer.global_step() == 8);
  const fs::path run = dir / "lightning_logs" / "version_0";
  REQUIRE(trainer.log_dir() == run.string());

  // hparams.yaml: the module's and the data's hyperparameters, as Lightning's; the trainer's and
  // the plugins' keys are the run's config.toml (#42.10).
  const std::string yaml = fulgur::test::read_bytes(run / "hparams.yaml");
  FULGUR_CHECK_CONTAINS(yaml, "model.set_in_code: 1.5");
  FULGUR_CHECK_CONTAINS(yaml, "data.batch: 8");
  CHECK_FALSE(fulgur::test::contains(yaml, "trainer."));
  CHECK_FALSE(fulgur::test::contains(yaml, "accelerator."));

  auto csv = read_csv(run / "metrics.csv");
  // lr_monitor: Lightning's names per group, logged on every logging step (steps 1, 3, 5, 7).
  REQUIRE(csv.count("lr-SGD/pg1"));
  REQUIRE(csv.count("lr-SGD/pg2"));
  CHECK(numbers(csv["lr-SGD/pg1"]) == std::vector<double>{0.1, 0.1, 0.1, 0.1});
  CHECK(numbers(csv["lr-SGD/pg2"]) == std::vector<double>{0.01, 0.01, 0.01, 0.01});
  CHECK(numbers(csv["lr-SGD/pg1-momentum"]) == std::vector<double>{0.9, 0.9, 0.9, 0.9});
  // throughput_monitor: on steps 2, 4, 6, 8 (rows 1, 3, 5, 7); samples are exact, rates positive,
  // FLOPs counted on batch 1 (two linear layers: forward and backward matmuls at least).
  const std::vector<double> samples = numbers(csv["train/samples"]);
  CHECK(samples == std::vector<double>{16, 32, 48, 64});
  const auto samples_per_sec = numbers(csv["train/samples_per_sec"]);
  CHECK(samples_per_sec.size() == samples.size());  // a column that stopped being logged fails here
  CHECK(!samples_per_sec.empty());
  for (double v : samples_per_sec) CHECK(v > 0);
  const auto flops = numbers(csv["train/device/flops_per_sec"]);
  const auto rate = numbers(csv["train/device/samples_per_sec"]);
  const auto mfu = numbers(csv["train/device/mfu"]);
  REQUIRE(flops.size() == 4);
  REQUIRE(mfu.size() == 4);
  for (size_t i = 0; i < flops.size(); ++i) {
    // Per sample: fc1 forward 2*8*16, fc2 forward 2*16*3 and their backward matmuls: > 2*(256+96).
    CHECK(flops[i] / rate[i] >= 2.0 * (256 + 96));
    CHECK(mfu[i] == doctest::Approx(flops[i] / 1e9));
  }
  // device_stats: CPU memory and utilisation, at batch start and end of logging steps.
  const auto rss_at_start = numbers(csv["DeviceStatsMonitor.on_train_batch_start/rss_mb"]);
  CHECK(rss_at_start.size() == 4);  // operator[] would make a missing column empty: count it
  for (double v : rss_at_start) CHECK(v > 0);
  CHECK(numbers(csv["DeviceStatsMonitor.on_train_batch_end/rss_mb"]).size() == 4);
  CHECK(csv.count("DeviceStatsMonitor.on_train_batch_end/cpu_vm_percent"));

  // The same values reach TensorBoard.
  check_python(dir, tensorboard_script(R"(
s = set(ea.Tags()["scalars"])
for tag in ["train/loss", "lr-SGD/pg1", "lr-SGD/pg2", "train/samples_per_sec", "train/mfu",
            "DeviceStatsMonitor.on_train_batch_start/rss_mb", "epoch", "hp_metric"]:
    assert tag in s, (tag, sorted(s))
assert [st for st, _ in scalars("lr-SGD/pg1")] == [1, 3, 5, 7], scalars("lr-SGD/pg1")
assert all(close(v, 0.1) for _, v in scalars("lr-SGD/pg1"))
assert [v for _, v in scalars("train/samples")] == [16.0, 32.0, 48.0, 64.0]
content = ea.PluginTagToContent("hparams")
start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
assert start.hparams["model.set_in_code"].number_value == 1.5
assert start.hparams["trainer.max_steps"].number_value == 8
)"),
               run.string());
}

TEST_CASE("lr_monitor: epoch interval, and a run without a logger is refused") {
  TempDir dir;
  SUBCASE("epoch interval") {
    fulgur::Trainer trainer(config_from(dir, R"(
max_epochs = 2
limit_train_batches = 3
[[loggers]]
name = "csv"
[[callbacks]]
name = "lr_monitor"
logging_interval = "epoch"
)"));
    TinyModule module;
    TinyData data;
    trainer.fit(module, data);
    auto csv = read_csv(fs::path(trainer.log_dir()) / "metrics.csv");
    CHECK(numbers(csv["lr-SGD/pg2"]) == std::vector<double>{0.01, 0.01});
    // Logged at each epoch start: steps 0 and 3.
    std::vector<std::string> steps;
    for (size_t i = 0; i < csv["step"].size(); ++i)
      if (!csv["lr-SGD/pg2"][i].empty()) steps.push_back(csv["step"][i]);
    CHECK(steps == std::vector<std::string>{"0", "3"});
  }
  SUBCASE("no logger") {
    fulgur::Trainer trainer(config_from(dir, "max_steps = 2\nlogger = false\n[[callbacks]]\nname = \"lr_monitor\"\n"));
    TinyModule module;
    TinyData data;
    const fulgur::Error error = error_from([&] { trainer.fit(module, data); });
    CHECK(error.kind() == fulgur::ErrorKind::config);
    FULGUR_CHECK_CONTAINS(error.what(), "lr_monitor");
    FULGUR_CHECK_CONTAINS(error.what(), "no logger");
  }
}

// ---- timer -------------------------------------------------------------------------------------------

TEST_CASE("timer: elapsed time travels in the checkpoint and stops a resumed run that is over its limit") {
  TempDir dir;
  const fs::path ckpt = dir / "run.ckpt";
  {
    fulgur::Trainer trainer(config_from(dir, "max_steps = 3\nlogger = false"));
    trainer.add_callback(
        create<fulgur::Callback>(fulgur::PluginKind::callback, "timer", {{"duration", std::string("01:00:00:00")}}));
    TinyModule module;
    TinyData data;
    trainer.fit(module, data);
    CHECK(trainer.global_step() == 3);  // far from the limit: not stopped early
    trainer.save_checkpoint(ckpt.string());
  }
  // The state is Lightning's: callbacks["Timer"]["time_elapsed"]{"fit", "validate", "test", "predict"}.
  c10::IValue checkpoint = fulgur::read_checkpoint_file(ckpt.string());
  auto callbacks = checkpoint.toGenericDict().at("callbacks").toGenericDict();
  auto elapsed = callbacks.at("Timer").toGenericDict().at("time_elapsed").toGenericDict();
  CHECK(elapsed.at("fit").toDouble() > 0);
  CHECK(elapsed.contains("validate"));
  // Pretend the first run had already used the whole day: the resumed run stops after one step.
  elapsed.insert_or_assign("fit", 86400.0);
  fulgur::write_checkpoint_file(checkpoint, ckpt.string());

  fulgur::Trainer resumed(config_from(dir, "max_steps = 20\nlogger = false"));
  resumed.add_callback(
      create<fulgur::Callback>(fulgur::PluginKind::callback, "timer", {{"duration", std::string("86400")}}));
  TinyModule module;
  TinyData data;
  resumed.fit(module, data, ckpt.string());
  CHECK(resumed.global_step() == 4);
  CHECK(module.training_steps == 1);
  CHECK(resumed.should_stop());
}

TEST_CASE("timer: a duration that is not DD:HH:MM:SS or seconds is refused when the plugin is created") {
  for (const char* bad : {"1:2:3:4:5", "ten minutes", "00:-1:00:00", "0"}) {
    CAPTURE(bad);
    const fulgur::Error error = error_from([&] {
      create<fulgur::Callback>(fulgur::PluginKind::callback, "timer", {{"duration", std::string(bad)}});
    });
    FULGUR_CHECK_CONTAINS(error.what(), "DD:HH:MM:SS");
  }
  CHECK(create<fulgur::Callback>(fulgur::PluginKind::callback, "timer", {{"duration", std::string("00:00:01:30")}}));
}

// ---- pytorch profiler ------------------------------------------------------------------------------

TEST_CASE("pytorch profiler: Chrome traces with the Trainer's actions next to aten ops, and a summary") {
  TempDir dir;
  int64_t wait = 1, warmup = 1, active = 2, repeat = 2;
  SUBCASE("wait, warmup and two cycles") {}
  SUBCASE("recording from the first step") { wait = warmup = 0; }
  fulgur::Trainer trainer(config_from(dir, fmt::format(R"(
max_steps = 8
logger = false
[profiler]
name = "pytorch"
wait = {}
warmup = {}
active = {}
repeat = {}
)",
                                                       wait, warmup, active, repeat)));
  TinyModule module;
  TinyData data;
  trainer.fit(module, data);
  const fs::path trace0 = dir / "fit-profile.0.pt.trace.json";
  const fs::path trace1 = dir / "fit-profile.1.pt.trace.json";
  REQUIRE(fs::exists(trace0));
  REQUIRE(fs::exists(trace1));
  CHECK_FALSE(fs::exists(dir / "fit-profile.2.pt.trace.json"));  // repeat = 2
  const std::string summary = fulgur::test::read_bytes(dir / "fit-profile.txt");
  FULGUR_CHECK_CONTAINS(summary, "Self CPU");
  FULGUR_CHECK_CONTAINS(summary, "aten::");
  FULGUR_CHECK_CONTAINS(summary, "2 recorded cycle(s)");

  check_python(dir,
               fmt::format(R"(
import json, sys
for path in sys.argv[1:]:
    trace = json.load(open(path))
    names = [e.get("name", "") for e in trace["traceEvents"]]
    for action in ["run_training_batch", "training_step", "backward", "optimizer_step", "optimizer_zero_grad",
                   "train_dataloader_next", "transfer_batch_to_device"]:
        assert action in names, (path, action)
    assert names.count("run_training_batch") == {}, (path, names.count("run_training_batch"))
    assert any(n.startswith("aten::addmm") for n in names), path
    assert any(n.startswith("aten::") and "backward" in n.lower() or "Backward" in n for n in names), path
print("python-ok")
)",
                           active),
               trace0.string() + " " + trace1.string());
}
