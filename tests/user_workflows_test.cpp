// What a new user tripped on (issue #42), driven from the user's side: TOML files written here,
// the shipped `fulgur` in real processes, weights files in the formats people have (safetensors,
// torch.save state dicts, Lightning checkpoints), an out-of-tree model plugin, and what lands on
// disk and in the output.
#include "test_support.h"
#include "training_job.h"

#include <fulgur/abi.h>
#include <fulgur/checkpoint_io.h>
#include <fulgur/host.h>
#include <fulgur/weights.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/equal.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <string>
#include <vector>

namespace {

using namespace fulgur::test;
using fulgur::test::job::checkpoint_dict;
using fulgur::test::job::files_in;
using fulgur::test::job::same_weights;

// The Fashion-MNIST MLP and datamodule plugins, 4 batches of 32 per epoch, a checkpoint at every
// epoch end (all kept) in <root>/ckpt, and last.ckpt.
std::string base_toml(const fs::path& root, const std::string& trainer_extra = "") {
  return fmt::format(
      "[trainer]\nmax_epochs = 1\nseed = 7\nlimit_train_batches = 4\nlimit_val_batches = 2\nlimit_test_batches = 2\n"
      "limit_predict_batches = 2\nnum_sanity_val_steps = 0\nenable_progress_bar = false\n"
      "enable_model_summary = false\ndefault_root_dir = \"{}\"\n{}\n"
      "[model]\nname = \"fashion_mnist_mlp\"\nlr = 0.002\n\n[data]\nname = \"fashion_mnist\"\nbatch_size = 32\n\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"{}\"\nevery_n_epochs = 1\nsave_top_k = -1\n"
      "save_last = true\nmonitor = \"val/acc\"\nmode = \"max\"\n",
      (root / "runs").string(), trainer_extra, (root / "ckpt").string());
}

ProcessRun fulgur_cmd(const fs::path& dir, std::vector<std::string> args, const std::string& level = "warn") {
  args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
  return run_process(args, {{"FULGUR_LOG_LEVEL", level}, {"FULGUR_PLUGIN_PATH", ""}}, dir);
}

// The model weights of a checkpoint, by name.
fulgur::TensorMap weights_of(const fs::path& ckpt) { return fulgur::read_weights(ckpt.string()); }

fulgur::TensorMap with_prefix(const fulgur::TensorMap& tensors, const std::string& prefix) {
  fulgur::TensorMap out;
  for (const auto& [k, v] : tensors) out.emplace(prefix + k, v);
  return out;
}

// True when `ckpt` holds exactly `tensors` (bit for bit, same names).
bool holds(const fs::path& ckpt, const fulgur::TensorMap& tensors) {
  const fulgur::TensorMap got = weights_of(ckpt);
  if (got.size() != tensors.size()) return false;
  for (const auto& [k, v] : tensors)
    if (!got.count(k) || !at::equal(got.at(k), v)) return false;
  return true;
}

// A checkpoint as Python's Lightning writes it: its own loop counters under `loops` (no Fulgur
// position or RNG state), no fulgur_version; made from a Fulgur checkpoint of the same model.
void write_lightning_checkpoint(const fs::path& from, const fs::path& to, const std::string& prefix) {
  auto ckpt = checkpoint_dict(from);
  (void)ckpt.erase("fulgur_version");
  (void)ckpt.erase("world_size");
  (void)ckpt.erase("epoch_batches");
  auto loops = ckpt.at("loops").toGenericDict();
  for (const auto& loop : loops) {
    auto state = loop.value().toGenericDict();
    std::vector<std::string> fulgur_keys;
    for (const auto& entry : state) {
      const std::string key = entry.key().toStringRef();
      if (key != "state_dict" && key.find("progress") == std::string::npos && !key.starts_with("epoch_loop."))
        fulgur_keys.push_back(key);
    }
    for (const std::string& key : fulgur_keys) (void)state.erase(key);
  }
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, v] : with_prefix(weights_of(from), prefix)) state.insert(k, v);
  ckpt.insert_or_assign("state_dict", state);
  fulgur::write_checkpoint_file(c10::IValue(ckpt), to.string());
}

std::string line_with(const std::string& text, const std::string& part) {
  const size_t at = text.find(part);
  if (at == std::string::npos) return {};
  const size_t start = text.rfind('\n', at) == std::string::npos ? 0 : text.rfind('\n', at) + 1;
  return text.substr(start, text.find('\n', at) - start);
}

}  // namespace

TEST_CASE("init_weights: fit starts from a safetensors, torch.save or Lightning file named in the TOML") {
  TempDir dir;
  // Pretrained weights: one epoch of another run, written in the formats people exchange.
  write_bytes(dir / "pretrain.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "pretrain.toml"}).exit_code == 0);
  const fulgur::TensorMap pretrained = weights_of(dir / "ckpt" / "last.ckpt");
  const fs::path weights = dir.subdir("weights");
  fulgur::save_weights(pretrained, (weights / "net.safetensors").string());
  fulgur::save_weights(pretrained, (weights / "net.pt").string());  // torch.save(model.state_dict())
  write_lightning_checkpoint(dir / "ckpt" / "last.ckpt", weights / "lightning.ckpt", "model.");

  // lr = 1e-30: Adam's steps vanish next to float32 weights, so last.ckpt shows what was loaded.
  // The path is relative to the TOML file, and the run starts in another directory.
  const fs::path elsewhere = dir.subdir("elsewhere");
  auto fit_from = [&](const std::string& name, const std::string& keys) {
    const fs::path run = dir.subdir(name);
    write_bytes(run / "run.toml", base_toml(run, keys));
    return std::pair{
        run, fulgur_cmd(elsewhere, {"fit", "--config", (run / "run.toml").string(), "--model.lr=1e-30"}, "info")};
  };
  SUBCASE("safetensors") {
    const auto [run, out] = fit_from("st", "init_weights = \"../weights/net.safetensors\"\n");
    REQUIRE_MESSAGE(out.exit_code == 0, out.output);
    CHECK(holds(run / "ckpt" / "last.ckpt", pretrained));
    FULGUR_CHECK_CONTAINS(out.output, "initial weights loaded from " + (weights / "net.safetensors").string());
    // The saved config names the file absolutely: it reruns from anywhere.
    const fs::path version = run / "runs" / "lightning_logs" / files_in(run / "runs" / "lightning_logs").at(0);
    FULGUR_CHECK_CONTAINS(read_bytes(version / "config.toml"),
                          "init_weights = \"" + (weights / "net.safetensors").string() + "\"");
  }
  SUBCASE("torch.save state dict") {
    const auto [run, out] = fit_from("pt", "init_weights = \"../weights/net.pt\"\n");
    REQUIRE_MESSAGE(out.exit_code == 0, out.output);
    CHECK(holds(run / "ckpt" / "last.ckpt", pretrained));
  }
  SUBCASE("a Lightning checkpoint whose keys carry the LightningModule's attribute") {
    const auto [refused_run, refused] = fit_from("lit_refused", "init_weights = \"../weights/lightning.ckpt\"\n");
    CHECK(refused.exit_code != 0);
    FULGUR_CHECK_CONTAINS(refused.output,
                          "the file's keys look prefixed: try [trainer] init_weights_strip_prefix = "
                          "\"model.\"");
    const auto [run, out] =
        fit_from("lit", "init_weights = \"../weights/lightning.ckpt\"\ninit_weights_strip_prefix = \"model.\"\n");
    REQUIRE_MESSAGE(out.exit_code == 0, out.output);
    CHECK(holds(run / "ckpt" / "last.ckpt", pretrained));
  }
  SUBCASE("a missing file is refused before anything starts") {
    const auto [run, out] = fit_from("missing", "init_weights = \"../weights/nope.safetensors\"\n");
    CHECK(out.exit_code == 2);
    FULGUR_CHECK_CONTAINS(out.output,
                          "init_weights = \"" + (weights / "nope.safetensors").string() + "\": no such file");
    CHECK_FALSE(fs::exists(run / "runs"));
  }
}

TEST_CASE("init_weights never overwrites a resumed run: it resumes bit for bit with its own weights") {
  TempDir dir;
  write_bytes(dir / "pretrain.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "pretrain.toml", "--model.lr=0.01"}).exit_code == 0);
  fulgur::save_weights(weights_of(dir / "ckpt" / "last.ckpt"), (dir / "pretrained.safetensors").string());

  // Two epochs straight from the pretrained weights, a checkpoint at each epoch end.
  const std::string init = "init_weights = \"pretrained.safetensors\"\n";
  write_bytes(dir / "run.toml", base_toml(dir.path(), init));
  const ProcessRun straight =
      fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--trainer.max_epochs=2",
                              "--callbacks.model_checkpoint.dirpath=" + (dir / "straight").string()});
  REQUIRE_MESSAGE(straight.exit_code == 0, straight.output);
  const fs::path epoch0 = dir / "straight" / "epoch=0-step=4.ckpt", epoch1 = dir / "straight" / "epoch=1-step=8.ckpt";
  REQUIRE_MESSAGE(fs::exists(epoch0), fmt::format("{}", fmt::join(files_in(dir / "straight"), ", ")));
  REQUIRE(fs::exists(epoch1));
  // The same config (init_weights still set) resumed after epoch 0: the checkpoint's weights win.
  const ProcessRun resumed =
      fulgur_cmd(dir.path(),
                 {"fit", "--config", "run.toml", "--trainer.max_epochs=2", "--ckpt_path=" + epoch0.string(),
                  "--callbacks.model_checkpoint.dirpath=" + (dir / "resumed").string()},
                 "info");
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  FULGUR_CHECK_CONTAINS(resumed.output, "is not loaded: the run resumes from");
  CHECK_FALSE(contains(resumed.output, "initial weights loaded"));
  REQUIRE(fs::exists(dir / "resumed" / "epoch=1-step=8.ckpt"));
  CHECK(same_weights(dir / "resumed" / "epoch=1-step=8.ckpt", epoch1));
}

TEST_CASE("--ckpt_path takes safetensors and bare state dicts for test, and fit refuses a Lightning checkpoint") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "run.toml"}).exit_code == 0);
  const fs::path last = dir / "ckpt" / "last.ckpt";
  const fulgur::TensorMap trained = weights_of(last);
  fulgur::save_weights(trained, (dir / "net.safetensors").string());
  fulgur::save_weights(trained, (dir / "net.pt").string());
  fulgur::save_weights(with_prefix(trained, "model."), (dir / "prefixed.safetensors").string());
  write_lightning_checkpoint(last, dir / "lightning.ckpt", "");

  const ProcessRun reference = fulgur_cmd(dir.path(), {"test", "--config", "run.toml", "--ckpt_path=" + last.string()});
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);
  const std::string accuracy = line_with(reference.output, "test/acc");
  REQUIRE_FALSE(accuracy.empty());
  for (const char* file : {"net.safetensors", "net.pt"}) {
    CAPTURE(file);
    const ProcessRun run =
        fulgur_cmd(dir.path(), {"test", "--config", "run.toml", std::string("--ckpt_path=") + file}, "info");
    REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    CHECK(line_with(run.output, "test/acc") == accuracy);  // the same weights, the same accuracy
    FULGUR_CHECK_CONTAINS(run.output, "weights only");
  }
  // Keys that differ by a prefix: refused before the stage starts, saying which key maps them.
  const ProcessRun prefixed =
      fulgur_cmd(dir.path(), {"predict", "--config", "run.toml", "--ckpt_path=prefixed.safetensors"});
  CHECK(prefixed.exit_code == 2);
  FULGUR_CHECK_CONTAINS(prefixed.output, "init_weights_strip_prefix = \"model.\"");

  // fit resumes runs: Lightning's loop state and bare weights are refused for what they are.
  const ProcessRun lightning = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--ckpt_path=lightning.ckpt"});
  CHECK(lightning.exit_code == 2);
  FULGUR_CHECK_CONTAINS(lightning.output, "was written by PyTorch Lightning 2.6.0, not by Fulgur");
  FULGUR_CHECK_CONTAINS(lightning.output, "[trainer] init_weights = \"" + (dir / "lightning.ckpt").string() + "\"");
  CHECK_FALSE(contains(lightning.output, "key 'epoch' is missing"));
  const ProcessRun bare = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--ckpt_path=net.safetensors"});
  CHECK(bare.exit_code == 2);
  FULGUR_CHECK_CONTAINS(bare.output, "holds weights only (safetensors)");
  FULGUR_CHECK_CONTAINS(bare.output, "init_weights");
}

TEST_CASE("an error in the user's training_step names the stage, hook, epoch and batch, frames only at debug") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"user-model"});
  write_bytes(dir / "run.toml",
              fmt::format("[plugins]\npaths = [\"{}\"]\n[trainer]\nmax_epochs = 1\nlimit_train_batches = 4\n"
                          "limit_val_batches = 0\nenable_progress_bar = false\nenable_model_summary = false\n"
                          "default_root_dir = \"{}\"\n[model]\nname = \"shape_bug_net\"\nfail_at_batch = 2\n"
                          "[data]\nname = \"fashion_mnist\"\nbatch_size = 32\n",
                          plugins.string(), (dir / "runs").string()));
  const ProcessRun run = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml"});
  CHECK(run.exit_code == 1);
  FULGUR_CHECK_CONTAINS(run.output, "failed in training_step (stage fit, epoch 0, batch 2, global step 2)");
  FULGUR_CHECK_CONTAINS(run.output, "mat1 and mat2 shapes cannot be multiplied (32x784 and 100x10)");
  CHECK_FALSE(contains(run.output, "internal error"));
  CHECK_FALSE(contains(run.output, "frame #"));
  const ProcessRun debug = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml"}, "debug");
  CHECK(debug.exit_code == 1);
  FULGUR_CHECK_CONTAINS(debug.output, "libtorch's stack at the error");
}

TEST_CASE("test --ckpt_path=best says which file it loads, and the saved command line names it absolutely") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--trainer.max_epochs=2"}).exit_code == 0);
  const ProcessRun best = fulgur_cmd(dir.path(), {"test", "--config", "run.toml", "--ckpt_path=best"}, "info");
  REQUIRE_MESSAGE(best.exit_code == 0, best.output);
  FULGUR_CHECK_CONTAINS(best.output,
                        "Restoring states from the checkpoint path at " + (dir / "ckpt").string() + "/epoch=");

  const fs::path sub = dir.subdir("sub");
  const ProcessRun relative =
      fulgur_cmd(sub, {"test", "--config", "../run.toml", "--ckpt_path=../ckpt/last.ckpt"}, "info");
  REQUIRE_MESSAGE(relative.exit_code == 0, relative.output);
  const std::string absolute = (dir / "ckpt" / "last.ckpt").string();
  FULGUR_CHECK_CONTAINS(relative.output, "Restoring states from the checkpoint path at " + absolute);
  const std::string config_line = line_with(relative.output, "config: ");
  REQUIRE_FALSE(config_line.empty());
  const std::string saved = read_bytes(config_line.substr(config_line.find("config: ") + 8));
  FULGUR_CHECK_CONTAINS(saved, "fulgur test --config <this file> --ckpt_path=" + absolute);
}

TEST_CASE("a plugin built against another libtorch is told to rebuild against this Fulgur's SDK, both named") {
  TempDir dir;
  const fs::path plugins = dir.subdir("plugins");
  copy_library(fixture("libfulgur-fixture-other-abi.so"), plugins / "libfulgur-fixture-other-abi.so");
  copy_library(fixture("libfulgur-fixture-good.so"), plugins / "libfulgur-fixture-good.so");
  const ProcessRun run =
      run_process({FULGUR_TEST_FULGUR_BIN, "plugins", "describe", "fixture_other_abi"},
                  {{"FULGUR_PLUGIN_PATH", plugins.string()}, {"FULGUR_LOG_LEVEL", "warn"}}, dir.path());
  const uint32_t sdk = fulgur::host_abi_tag().sdk_version;
  const std::string host_sdk = fmt::format("{}.{}", FULGUR_SDK_VERSION_MAJOR_OF(sdk), FULGUR_SDK_VERSION_MINOR_OF(sdk));
  const std::string host_torch =
      fmt::format("{}.{}", fulgur::host_abi_tag().torch_major, fulgur::host_abi_tag().torch_minor);
  FULGUR_CHECK_CONTAINS(run.output, fmt::format("built against Fulgur SDK {} with libtorch {}.{}", host_sdk,
                                                fulgur::host_abi_tag().torch_major, FULGUR_TEST_OTHER_TORCH_MINOR));
  FULGUR_CHECK_CONTAINS(run.output, fmt::format("this host is Fulgur SDK {} with libtorch {}", host_sdk, host_torch));
  FULGUR_CHECK_CONTAINS(run.output, "rebuild the plugin against this Fulgur's SDK");
  CHECK_FALSE(contains(run.output, "against the libtorch this Fulgur uses"));

  // `describe` shows the SDK a plugin was built against next to the host's.
  const ProcessRun good =
      run_process({FULGUR_TEST_FULGUR_BIN, "plugins", "describe", "fixture_good"},
                  {{"FULGUR_PLUGIN_PATH", plugins.string()}, {"FULGUR_LOG_LEVEL", "warn"}}, dir.path());
  REQUIRE_MESSAGE(good.exit_code == 0, good.output);
  FULGUR_CHECK_CONTAINS(good.output, fmt::format("SDK:    {} (this host: {})", host_sdk, host_sdk));
}

TEST_CASE("messages that list alternatives end the first sentence before the list") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()) + "[[loggers]]\nname = \"exp1\"\n");
  const ProcessRun logger = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml"});
  CHECK(logger.exit_code == 2);
  FULGUR_CHECK_CONTAINS(logger.output, "no logger plugin named 'exp1'. Available logger plugins: ");
  const ProcessRun key = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--trainer.zzzzzzzz=1"});
  CHECK(key.exit_code == 2);
  FULGUR_CHECK_CONTAINS(key.output, "unknown key 'zzzzzzzz' for [trainer]. Known keys: ");
  const ProcessRun section = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--qqqqqqqq.x=1"});
  CHECK(section.exit_code == 2);
  FULGUR_CHECK_CONTAINS(section.output, "no section 'qqqqqqqq'. Sections: ");
}

TEST_CASE("fulgur predict keeps the predictions: a file in the log directory, named in the output") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "run.toml"}).exit_code == 0);
  const ProcessRun run = fulgur_cmd(dir.path(), {"predict", "--config", "run.toml", "--ckpt_path=last"});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  FULGUR_CHECK_CONTAINS(run.output, "predict: 2 batches");
  const std::string line = line_with(run.output, "predictions: ");
  REQUIRE_MESSAGE(!line.empty(), run.output);
  const fs::path file = line.substr(13, line.find(" (") - 13);
  CHECK(file.filename() == "predictions.pt");
  const c10::IValue saved = fulgur::read_checkpoint_file(file.string());
  REQUIRE(saved.isList());
  REQUIRE(saved.toList().size() == 2);
  const at::Tensor first = saved.toList().get(0).toTensor();
  CHECK(first.size(0) == 32);  // one row per sample of the batch
  CHECK(first.size(1) == 10);  // the model's 10 class scores
}
