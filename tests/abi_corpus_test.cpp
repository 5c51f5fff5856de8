// The SDK 1.x promise on real binaries (issue #32): the ABI corpus (tests/abi/corpus, one plugin per
// kind) is compiled against the frozen SDK 1.0 headers (tests/abi/sdk-1.0), and this host loads,
// checks and runs it: in process through the testing kit, and end to end through `fulgur fit`.
// When the SDK grows (1.1, 1.2, ...), these binaries keep their 1.0 vtables and layouts: the tests
// fail the day a change breaks what a 1.0 plugin relies on.
#include "test_support.h"
#include "training_job.h"

#include <fulgur/testing/plugin_kit.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace fulgur::test;
namespace kit = fulgur::testing;
using fulgur::PluginKind;

const std::vector<std::string> kCorpusDir = {FULGUR_TEST_ABI_CORPUS_DIR};

// Each corpus plugin: its kind and name (tests/abi/corpus/<kind>.cpp).
const std::vector<std::pair<PluginKind, std::string>> kCorpus = {
    {PluginKind::accelerator, "corpus_cpu"},   {PluginKind::strategy, "corpus_single"},
    {PluginKind::precision, "corpus_bf16"},    {PluginKind::logger, "corpus_rows"},
    {PluginKind::profiler, "corpus_counting"}, {PluginKind::callback, "corpus_epoch_marker"},
    {PluginKind::model, "corpus_line_model"},  {PluginKind::datamodule, "corpus_line_data"}};

template <class T>
std::shared_ptr<T> corpus_plugin(PluginKind kind, std::string_view name) {
  return kit::create_plugin<T>(kind, name, {}, kCorpusDir);
}

// The value of `key` in the trainer's metrics, or fails the test naming what was there.
double metric(const fulgur::MetricMap& metrics, const std::string& key) {
  const auto it = metrics.find(key);
  REQUIRE_MESSAGE(it != metrics.end(), "no " << key << " among " << metrics.size() << " metrics");
  return it->second;
}

}  // namespace

TEST_CASE("SDK 1.0 corpus: every plugin records SDK 1.0 and passes its kind's conformance check in this host") {
  for (const auto& [kind, name] : kCorpus) {
    const fulgur::PluginCandidate& candidate = kit::registry_for(kCorpusDir).resolve(kind, name);
    CHECK_MESSAGE(candidate.metadata.abi_tag.sdk_version == ((1u << 16) | 0u),
                  name << " was not built against the frozen SDK 1.0 headers");
  }
  CHECK_NOTHROW(
      kit::check_accelerator_conformance(corpus_plugin<fulgur::Accelerator>(PluginKind::accelerator, "corpus_cpu")));
  CHECK_NOTHROW(
      kit::check_strategy_conformance(corpus_plugin<fulgur::Strategy>(PluginKind::strategy, "corpus_single")));
  CHECK_NOTHROW(
      kit::check_precision_conformance(corpus_plugin<fulgur::Precision>(PluginKind::precision, "corpus_bf16")));
  CHECK_NOTHROW(kit::check_logger_conformance(corpus_plugin<fulgur::Logger>(PluginKind::logger, "corpus_rows")));
  CHECK_NOTHROW(
      kit::check_profiler_conformance(corpus_plugin<fulgur::Profiler>(PluginKind::profiler, "corpus_counting")));
  CHECK_NOTHROW(
      kit::check_callback_conformance(corpus_plugin<fulgur::Callback>(PluginKind::callback, "corpus_epoch_marker")));
  // The 1.0 extensions the corpus implements answer through this host's find_extension.
  CHECK(fulgur::find_extension<fulgur::StagedTransfers>(
            corpus_plugin<fulgur::Accelerator>(PluginKind::accelerator, "corpus_cpu").get()) != nullptr);
  CHECK(fulgur::find_extension<fulgur::DeviceStepStrategy>(
            corpus_plugin<fulgur::Strategy>(PluginKind::strategy, "corpus_single").get()) != nullptr);
  CHECK(fulgur::find_extension<fulgur::StepGraphFactory>(
            corpus_plugin<fulgur::Accelerator>(PluginKind::accelerator, "corpus_cpu").get()) == nullptr);
}

TEST_CASE("SDK 1.0 corpus: its model and datamodule train in this host's Trainer") {
  const auto created = corpus_plugin<fulgur::Module>(PluginKind::model, "corpus_line_model");
  // Owned by a shared_ptr of its own, as `fulgur fit` adopts a model plugin: torch::nn::Module uses
  // enable_shared_from_this.
  const std::shared_ptr<fulgur::Module> model(created.get(), [keep = created](fulgur::Module*) {});
  const auto data = corpus_plugin<fulgur::DataModule>(PluginKind::datamodule, "corpus_line_data");
  TempDir dir;
  fulgur::Trainer trainer(fulgur::ConfigBuilder()
                              .default_root_dir(dir.path())
                              .max_epochs(2)
                              .seed(3)
                              .num_sanity_val_steps(0)
                              .enable_progress_bar(false)
                              .enable_model_summary(false)
                              .enable_checkpointing(false)
                              .default_logger(false));
  const double before = metric(trainer.validate(*model, *data).at(0), "val/loss");
  trainer.fit(*model, *data);
  CHECK(trainer.global_step() == 2 * 4);  // 64 points in batches of 16 (the schema's defaults)
  const double after = metric(trainer.validate(*model, *data).at(0), "val/loss");
  CHECK_MESSAGE(after < 0.5 * before, "val/loss " << before << " -> " << after);
}

TEST_CASE("SDK 1.0 corpus: `fulgur fit` trains with a corpus plugin of every kind, `plugins list` shows SDK 1.0") {
  TempDir dir;
  const fs::path runs = dir / "runs";
  write_bytes(dir / "corpus.toml",
              "[plugins]\npaths = [\"" + std::string(FULGUR_TEST_ABI_CORPUS_DIR) +
                  "\"]\nallow_writable = true\n\n"
                  "[trainer]\naccelerator = \"corpus_cpu\"\nstrategy = \"corpus_single\"\nprecision = \"corpus_bf16\"\n"
                  "max_epochs = 2\nseed = 3\nlog_every_n_steps = 1\nenable_progress_bar = false\n"
                  "enable_model_summary = false\ndefault_root_dir = \"" +
                  runs.string() +
                  "\"\n\n[profiler]\nname = \"corpus_counting\"\n\n[model]\nname = \"corpus_line_model\"\n\n"
                  "[data]\nname = \"corpus_line_data\"\nsamples = 64\nbatch_size = 16\n\n"
                  "[[loggers]]\nname = \"corpus_rows\"\n\n[[callbacks]]\nname = \"corpus_epoch_marker\"\n\n"
                  "[[callbacks]]\nname = \"device_stats\"\ncpu_stats = false\n\n"
                  "[[callbacks]]\nname = \"model_checkpoint\"\nsave_last = true\n");
  const std::map<std::string, std::string> env = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};

  const ProcessRun list =
      run_process({FULGUR_TEST_FULGUR_BIN, "plugins", "list", "--config", "corpus.toml"}, env, dir.path());
  REQUIRE_MESSAGE(list.exit_code == 0, list.output);
  for (const auto& [kind, name] : kCorpus) {
    // KIND NAME VERSION SDK STATUS FILE
    std::istringstream lines(list.output);
    bool found = false;
    for (std::string line; std::getline(lines, line);) {
      std::istringstream cells(line);
      std::string k, n, version, sdk, status;
      cells >> k >> n >> version >> sdk >> status;
      if (k != fulgur::to_string(kind) || n != name) continue;
      found = true;
      CHECK_MESSAGE(sdk == "1.0", line);
      CHECK_MESSAGE(status == "available", line);
    }
    CHECK_MESSAGE(found, name << " is not listed:\n" << list.output);
  }

  const ProcessRun fit = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "corpus.toml"}, env, dir.path());
  REQUIRE_MESSAGE(fit.exit_code == 0, fit.output);
  const fs::path version = runs / "corpus_rows" / "version_0";
  // The logger: a row per value, the run's status last.
  const auto rows = read_csv(version / "rows.csv");
  const auto& keys = rows.at("key");
  CHECK(std::count(keys.begin(), keys.end(), "train/loss") == 8);  // log_every_n_steps = 1: 2 epochs x 4
  CHECK(std::count(keys.begin(), keys.end(), "val/loss") >= 2);
  CHECK(keys.back() == "status");
  CHECK(rows.at("value").back() == "success");
  FULGUR_CHECK_CONTAINS(read_bytes(version / "hparams.csv"), "data.batch_size");
  // The accelerator's StagedTransfers (a 1.0 extension) carried every batch of an epoch but the
  // first, as its statistics (logged by device_stats) count.
  double staged = -1;
  for (size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == "DeviceStatsMonitor.on_train_batch_end/staged_batches") staged = std::stod(rows.at("value")[i]);
  CHECK(staged == 2 * 3);
  // The profiler's report, the callback's lines and its stamp in the checkpoint.
  FULGUR_CHECK_CONTAINS(read_bytes(version / "corpus_profile-fit.txt"), "optimizer_step");
  CHECK(read_bytes(runs / "corpus_epochs.txt") == "epoch=0 step=4\nepoch=1 step=8\n");
  const fs::path last = version / "checkpoints" / "last.ckpt";
  REQUIRE_MESSAGE(fs::exists(last), fit.output);
  const auto checkpoint = job::checkpoint_dict(last);
  // model_checkpoint saves after the last epoch's validation pass, before that epoch's
  // on_train_epoch_end (Lightning's order): the marker had seen one epoch end.
  CHECK(checkpoint.at("corpus_epochs").toInt() == 1);
  CHECK(checkpoint.at("callbacks").toGenericDict().at("corpus_epoch_marker").toInt() == 1);
  CHECK(checkpoint.at("global_step").toInt() == 8);
}
