// Checkpoints as Lightning checkpoints (issue #34, items 9 and 10). `fulgur fit` trains the
// Fashion-MNIST MLP from a TOML and its checkpoints go to the venv's PyTorch Lightning 2.6 in a
// real Python process (tests/python/lightning_checkpoint.py): Trainer.fit(ckpt_path=...) resumes
// at Fulgur's epoch and step with its weights and Adam state, and load_from_checkpoint reads the
// weights and hyper_parameters. Then [trainer] strict_loading on a checkpoint whose weights do
// not match the model, both ways.
#include "test_support.h"
#include "training_job.h"

#include <fulgur/checkpoint_io.h>

#include <ATen/core/ivalue.h>
#include <ATen/ops/ones.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

namespace {

using namespace fulgur::test;

constexpr const char* kScript = FULGUR_TEST_SOURCE_DIR "/tests/python/lightning_checkpoint.py";
const std::map<std::string, std::string> kEnv = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};

// 4 batches of 32 per epoch, Adam at lr 0.002; a checkpoint every 3 steps and at every epoch end,
// all kept: epoch=0-step=3, epoch=0-step=4, epoch=1-step=6, epoch=1-step=8 for 2 epochs.
std::string toml(const fs::path& root, int max_epochs, const std::string& trainer_extra,
                 const std::string& ckpt_dir = "ckpt") {
  return fmt::format(
      "[trainer]\nmax_epochs = {}\nseed = 7\nlimit_train_batches = 4\nlimit_val_batches = 2\n"
      "enable_progress_bar = false\nenable_model_summary = false\ndefault_root_dir = \"{}\"\n{}\n"
      "[model]\nname = \"fashion_mnist_mlp\"\nlr = 0.002\n\n[data]\nname = \"fashion_mnist\"\nbatch_size = 32\n\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"{}\"\nevery_n_train_steps = 3\nevery_n_epochs = 1\n"
      "save_top_k = -1\n",
      max_epochs, (root / "runs").string(), trainer_extra, (root / ckpt_dir).string());
}

ProcessRun fulgur_fit(const fs::path& dir, const std::string& config) {
  write_bytes(dir / "run.toml", config);
  return run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml"}, kEnv, dir);
}

// Whether the Python at FULGUR_PYTHON has Lightning (else the caller skips).
bool has_lightning() {
  const auto [status, output] = run_command(fmt::format("{} -c \"import lightning.pytorch\"", FULGUR_TEST_PYTHON));
  return status == 0;
}

// Runs the Lightning script; true when it printed "python-ok".
bool lightning_agrees(const std::vector<std::string>& args) {
  std::string command = fmt::format("cd {} && {} {}", fs::temp_directory_path().string(), FULGUR_TEST_PYTHON, kScript);
  for (const std::string& a : args) command += " " + a;
  const auto [status, output] = run_command(command);
  INFO(command << "\n" << output);
  CHECK(status == 0);
  return status == 0 && contains(output, "python-ok");
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("Lightning layout: Lightning 2.6 resumes a Fulgur checkpoint at its epoch and step, with Adam's state") {
  if (!has_lightning()) {
    skip_test("the Python at FULGUR_PYTHON has no lightning (scripts/setup.sh installs it)");
    return;
  }
  TempDir dir;
  const ProcessRun run = fulgur_fit(dir.path(), toml(dir.path(), 2, ""));
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const fs::path epoch_end = dir / "ckpt" / "epoch=1-step=8.ckpt", mid_epoch = dir / "ckpt" / "epoch=1-step=6.ckpt";
  REQUIRE_MESSAGE(fs::exists(epoch_end), fmt::format("{}", fmt::join(job::files_in(dir / "ckpt"), ", ")));
  REQUIRE(fs::exists(mid_epoch));
  // Saved at epoch 1's end: Lightning starts epoch 2 at step 8 and trains 4 more steps.
  CHECK(lightning_agrees({"resume", epoch_end.string(), "3", "2", "8", "12"}));
  // Saved after epoch 1's second batch: Lightning finishes that epoch (2 batches) and trains epoch 2.
  CHECK(lightning_agrees({"resume", mid_epoch.string(), "3", "1", "6", "12"}));
}

TEST_CASE("Lightning layout: load_from_checkpoint reads a Fulgur checkpoint's weights and hyper_parameters") {
  if (!has_lightning()) {
    skip_test("the Python at FULGUR_PYTHON has no lightning (scripts/setup.sh installs it)");
    return;
  }
  TempDir dir;
  const ProcessRun run = fulgur_fit(dir.path(), toml(dir.path(), 1, ""));
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const fs::path ckpt = dir / "ckpt" / "epoch=0-step=4.ckpt";
  REQUIRE(fs::exists(ckpt));
  const auto hparams = job::checkpoint_dict(ckpt).at("hyper_parameters").toGenericDict();
  CHECK(hparams.at("lr").toDouble() == 0.002);
  CHECK(lightning_agrees({"load", ckpt.string()}));
}

TEST_CASE("Lightning layout: Fulgur resumes bit for bit from its checkpoints, and from the previous layout's") {
  TempDir dir;
  REQUIRE_MESSAGE(fulgur_fit(dir.path(), toml(dir.path(), 2, "")).exit_code == 0, "the uninterrupted run");
  const fs::path mid_epoch = dir / "ckpt" / "epoch=1-step=6.ckpt", straight = dir / "ckpt" / "epoch=1-step=8.ckpt";
  // The same checkpoint as Fulgur wrote it before the loops carried Lightning's keys.
  auto checkpoint = job::checkpoint_dict(mid_epoch);
  auto loops = checkpoint.at("loops").toGenericDict();
  for (const auto& loop : loops) {
    auto state = loop.value().toGenericDict();
    std::vector<std::string> lightning_keys;
    for (const auto& entry : state) {
      const std::string key = entry.key().toStringRef();
      if (key == "state_dict" || key.find("progress") != std::string::npos || key.starts_with("epoch_loop."))
        lightning_keys.push_back(key);
    }
    CHECK(!lightning_keys.empty());
    for (const std::string& key : lightning_keys) (void)state.erase(key);
    if (auto val = state.find("val_loop"); val != state.end()) {
      auto val_state = val->value().toGenericDict();
      (void)val_state.erase("state_dict");
      (void)val_state.erase("batch_progress");
    }
  }
  const fs::path previous = dir / "previous_layout.ckpt";
  fulgur::write_checkpoint_file(c10::IValue(checkpoint), previous.string());

  for (const auto& [from, out] : {std::pair{mid_epoch, "resumed"}, std::pair{previous, "resumed_previous"}}) {
    INFO(from.string());
    const ProcessRun run =
        fulgur_fit(dir.path(), toml(dir.path(), 2, fmt::format("ckpt_path = \"{}\"\n", from.string()), out));
    REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    REQUIRE(fs::exists(dir / out / "epoch=1-step=8.ckpt"));
    CHECK(job::same_weights(dir / out / "epoch=1-step=8.ckpt", straight));
  }
}

TEST_CASE("strict_loading: true refuses unmatched weight keys naming them, false loads the rest with one warning") {
  TempDir dir;
  REQUIRE_MESSAGE(fulgur_fit(dir.path(), toml(dir.path(), 1, "")).exit_code == 0, "first run");
  // The checkpoint of epoch 0, edited: fc2.bias gone, a key the model lacks added.
  auto checkpoint = job::checkpoint_dict(dir / "ckpt" / "epoch=0-step=4.ckpt");
  auto weights = checkpoint.at("state_dict").toGenericDict();
  (void)weights.erase("fc2.bias");
  weights.insert("extra.weight", at::ones({3}));
  const fs::path edited = dir / "edited.ckpt";
  fulgur::write_checkpoint_file(c10::IValue(checkpoint), edited.string());
  const std::string resume = fmt::format("ckpt_path = \"{}\"\n", edited.string());

  SUBCASE("strict_loading = true (the default) refuses it and names both keys and the way out") {
    const ProcessRun run = fulgur_fit(dir.path(), toml(dir.path(), 2, resume, "resumed"));
    CHECK(run.exit_code != 0);
    // `fulgur fit` checks the file against the model before training (cli_runner.cpp).
    FULGUR_CHECK_CONTAINS(run.output, "1 of its weights are not in the model (e.g. 'extra.weight')");
    FULGUR_CHECK_CONTAINS(run.output, "1 of the model's are missing from it (e.g. 'fc2.bias')");
    FULGUR_CHECK_CONTAINS(run.output, "strict_loading = false loads the weights that match");
    CHECK(!fs::exists(dir / "resumed"));
  }
  SUBCASE("strict_loading = false resumes with what matches and warns once, listing the others") {
    const ProcessRun run = fulgur_fit(dir.path(), toml(dir.path(), 2, resume + "strict_loading = false\n", "resumed"));
    REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    CHECK(count(run.output, "strict_loading = false, so the model loads") == 1);
    FULGUR_CHECK_CONTAINS(run.output, "missing keys (left as the model initialized them): fc2.bias");
    FULGUR_CHECK_CONTAINS(run.output, "unexpected keys (ignored): extra.weight");
    // It resumed at step 4 (a fresh start would also have saved epoch 0's steps 3 and 4).
    CHECK(job::files_in(dir / "resumed") == std::vector<std::string>{"epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"});
  }
}
