// `fulgur fit | validate | test | predict` driven as a user drives it: the shipped executable, TOML
// files written here, flags, and what lands on disk (fulgur/cli.h).
#include "test_support.h"
#include "training_job.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace {

using namespace fulgur::test;
using fulgur::test::job::files_in;
using fulgur::test::job::same_weights;

// The Fashion-MNIST plugins (model fashion_mnist_mlp, datamodule fashion_mnist), a few batches.
std::string base_toml(const fs::path& root) {
  return "[trainer]\nmax_epochs = 2\nseed = 7\nlimit_train_batches = 4\nlimit_val_batches = 2\n"
         "limit_test_batches = 2\nlimit_predict_batches = 2\nenable_progress_bar = false\n"
         "enable_model_summary = false\ndefault_root_dir = \"" +
         (root / "runs").string() +
         "\"\n\n[model]\nname = \"fashion_mnist_mlp\"\nlr = 0.002\n\n[data]\nname = \"fashion_mnist\"\n"
         "batch_size = 32\n\n[[callbacks]]\nname = \"model_checkpoint\"\nmonitor = \"val/acc\"\nmode = \"max\"\n"
         "save_last = true\n";
}

const std::map<std::string, std::string> kEnv = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};

ProcessRun fulgur_cmd(const fs::path& dir, std::vector<std::string> args) {
  args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
  return run_process(args, kEnv, dir);
}

// The value of `key = ...` in the table `table` (or the first [[table]] entry) of a printed config.
std::string value_in(const std::string& toml, const std::string& table, const std::string& key) {
  size_t at = toml.find("\n[" + table + "]\n");
  if (at == std::string::npos && toml.starts_with("[" + table + "]\n")) at = 0;
  if (at == std::string::npos) at = toml.find("\n[[" + table + "]]\n");  // the first entry of an array
  REQUIRE_MESSAGE(at != std::string::npos, "no [" << table << "] in:\n" << toml);
  const size_t end = toml.find("\n[", at + 2);
  const size_t k = toml.find("\n" + key + " = ", at);
  REQUIRE_MESSAGE((k != std::string::npos && k < end), "no " << key << " in [" << table << "] of:\n" << toml);
  const size_t start = k + key.size() + 4;
  return toml.substr(start, toml.find('\n', start) - start);
}

// The config without its comment header (which names the time and the command).
std::string body(const std::string& saved) {
  const size_t at = saved.find("[trainer]");
  return at == std::string::npos ? saved : saved.substr(at);
}

fs::path only_version(const fs::path& runs) {
  const auto versions = files_in(runs / "lightning_logs");
  REQUIRE_MESSAGE(versions.size() == 1, "expected one version under " << runs.string());
  return runs / "lightning_logs" / versions[0];
}

}  // namespace

TEST_CASE("fulgur fit trains the model and datamodule plugins a TOML names and saves the merged config") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  const ProcessRun run = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml"});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const fs::path version = only_version(dir / "runs");
  FULGUR_CHECK_CONTAINS(run.output, "config: " + (version / "config.toml").string());
  const std::string saved = read_bytes(version / "config.toml");
  CHECK(value_in(saved, "model", "name") == "\"fashion_mnist_mlp\"");
  CHECK(value_in(saved, "model", "lr") == "0.002");
  CHECK(value_in(saved, "model", "optimizer") == "\"adam\"");  // the schema's default, written out
  CHECK(value_in(saved, "data", "batch_size") == "32");
  CHECK(fs::exists(version / "checkpoints" / "last.ckpt"));
  // The typed hyperparameters are what the checkpoint records.
  const auto hp = job::checkpoint_dict(version / "checkpoints" / "last.ckpt").at("hyper_parameters").toGenericDict();
  CHECK(hp.at("lr").toDouble() == doctest::Approx(0.002));
  CHECK(hp.at("weight_decay").toDouble() == 0.0);
}

TEST_CASE("layered configs: schema defaults, then files in order, then flags") {
  TempDir dir;
  write_bytes(dir / "base.toml", base_toml(dir.path()));
  write_bytes(dir / "more.toml", "[trainer]\nmax_epochs = 3\nlimit_val_batches = 1\n[model]\nlr = 0.01\n");
  const ProcessRun run =
      fulgur_cmd(dir.path(), {"fit", "--config", "base.toml", "--config=more.toml", "--model.lr=0.005",
                              "--data.batch_size", "16", "--callbacks.model_checkpoint.mode=min", "--print-config"});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const std::string& toml = run.output;
  CHECK(value_in(toml, "trainer", "max_epochs") == "3");         // the second file beats the first
  CHECK(value_in(toml, "trainer", "limit_val_batches") == "1");  // ... key by key:
  CHECK(value_in(toml, "trainer", "limit_train_batches") == "4");
  CHECK(value_in(toml, "trainer", "min_epochs") == "0");    // schema default
  CHECK(value_in(toml, "model", "lr") == "0.005");          // a flag beats every file
  CHECK(value_in(toml, "data", "batch_size") == "16");      // --key value works like --key=value
  CHECK(value_in(toml, "model", "momentum") == "0.9");      // the plugin schema's default
  CHECK(value_in(toml, "callbacks", "mode") == "\"min\"");  // the [[callbacks]] entry by plugin name
  CHECK(value_in(toml, "trainer", "limit_predict_batches") == "2");
  // Floats stay floats (1.0, not 1, which would read back as a count of batches).
  CHECK(value_in(toml, "trainer", "overfit_batches") == "0.0");
  // --print-config starts nothing.
  CHECK_FALSE(fs::exists(dir / "runs"));
}

TEST_CASE("the saved config fed back to fulgur fit reproduces the run exactly") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  const ProcessRun first =
      fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--trainer.max_epochs=1", "--model.lr=0.003"});
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  const fs::path v0 = only_version(dir / "runs");
  const fs::path saved = v0 / "config.toml";
  // The printed config is a fixed point: printing the saved one gives it back.
  const ProcessRun printed = fulgur_cmd(dir.path(), {"fit", "--config", saved.string(), "--print-config"});
  REQUIRE_MESSAGE(printed.exit_code == 0, printed.output);
  CHECK(printed.output == body(read_bytes(saved)));
  // From another directory: the saved paths are absolute.
  const fs::path elsewhere = dir.subdir("elsewhere");
  const ProcessRun again = fulgur_cmd(elsewhere, {"fit", "--config", saved.string()});
  REQUIRE_MESSAGE(again.exit_code == 0, again.output);
  const auto versions = files_in(dir / "runs" / "lightning_logs");
  REQUIRE(versions.size() == 2);
  const fs::path a = dir / "runs" / "lightning_logs" / versions[0] / "checkpoints" / "last.ckpt";
  const fs::path b = dir / "runs" / "lightning_logs" / versions[1] / "checkpoints" / "last.ckpt";
  CHECK(same_weights(a, b));
  // ... and the flags mattered: without them the weights differ.
  TempDir other;
  write_bytes(other / "run.toml", base_toml(other.path()));
  const ProcessRun plain = fulgur_cmd(other.path(), {"fit", "--config", "run.toml", "--trainer.max_epochs=1"});
  REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  CHECK_FALSE(same_weights(a, only_version(other / "runs") / "checkpoints" / "last.ckpt"));
}

TEST_CASE("fulgur validate, test and predict load a checkpoint and report") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--trainer.max_epochs=1"}).exit_code == 0);
  const fs::path ckpt = only_version(dir / "runs") / "checkpoints" / "last.ckpt";
  const ProcessRun validate =
      fulgur_cmd(dir.path(), {"validate", "--config", "run.toml", "--ckpt_path", ckpt.string()});
  REQUIRE_MESSAGE(validate.exit_code == 0, validate.output);
  FULGUR_CHECK_CONTAINS(validate.output, "validate results");
  FULGUR_CHECK_CONTAINS(validate.output, "val/acc");
  const ProcessRun test = fulgur_cmd(dir.path(), {"test", "--config", "run.toml", "--ckpt_path=" + ckpt.string()});
  REQUIRE_MESSAGE(test.exit_code == 0, test.output);
  FULGUR_CHECK_CONTAINS(test.output, "test/acc");
  const ProcessRun predict =
      fulgur_cmd(dir.path(), {"predict", "--config", "run.toml", "--ckpt_path=" + ckpt.string()});
  REQUIRE_MESSAGE(predict.exit_code == 0, predict.output);
  FULGUR_CHECK_CONTAINS(predict.output, "predict: 2 batches");
  // "best" in a new process: the best checkpoint the last one recorded.
  const ProcessRun best = fulgur_cmd(dir.path(), {"test", "--config", "run.toml", "--ckpt_path=best"});
  REQUIRE_MESSAGE(best.exit_code == 0, best.output);
  FULGUR_CHECK_CONTAINS(best.output, "test/acc");
}

TEST_CASE("bad command lines get one line and exit 2 before anything starts") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  write_bytes(dir / "no_model.toml", "[trainer]\nmax_epochs = 1\n[data]\nname = \"fashion_mnist\"\n");
  write_bytes(dir / "garbage.ckpt", "not a checkpoint at all");
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"fitt", "--config", "run.toml"}, "unknown command 'fitt'; did you mean 'fit'?"},
      {{"fit"}, "fit needs --config FILE"},
      {{"fit", "--config", "missing.toml"}, "missing.toml: cannot open the config file"},
      {{"fit", "--config", "run.toml", "--trainer.max_epoch=3"},
       "unknown key 'max_epoch' for [trainer]; did you mean 'max_epochs'?"},
      {{"fit", "--config", "run.toml", "--max_epochs=3"},
       "unknown flag --max_epochs=3; did you mean --trainer.max_epochs=3?"},
      {{"fit", "--config", "run.toml", "--trainer.max_epochs=abc"},
       "--trainer.max_epochs=abc: [trainer]: 'max_epochs' must be integer, found string"},
      {{"fit", "--config", "run.toml", "--model.lr=fast"},
       "--model.lr=fast: model 'fashion_mnist_mlp': 'lr' must be float, found string"},
      {{"fit", "--config", "run.toml", "--model.lrr=0.1"},
       "unknown key 'lrr' for model 'fashion_mnist_mlp'; did you mean 'lr'?"},
      {{"fit", "--config", "run.toml", "--model=fashion_mnist_mpl"},
       "no model plugin named 'fashion_mnist_mpl'; did you mean 'fashion_mnist_mlp'?"},
      {{"fit", "--config", "no_model.toml"}, "no model selected: add [model] name = \"...\""},
      {{"fit", "--config", "run.toml", "--callbacks.early_stopping.patience=3"},
       "no [[callbacks]] entry selects 'early_stopping'"},
      {{"fit", "--config", "run.toml", "--trainer.max_epochs"}, "--trainer.max_epochs needs a value"},
      {{"fit", "--config", "run.toml", "stray"}, "unexpected argument 'stray'"},
      {{"test", "--config", "run.toml", "--ckpt_path=nowhere.ckpt"}, "--ckpt_path: no checkpoint at 'nowhere.ckpt'"},
      {{"fit", "--config", "run.toml", "--ckpt_path=garbage.ckpt"}, "garbage.ckpt"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args[0]);
    CAPTURE(c.args.back());
    const ProcessRun run = fulgur_cmd(dir.path(), c.args);
    CHECK(run.exit_code == 2);
    FULGUR_CHECK_CONTAINS(run.output, c.needle);
    CHECK_FALSE(fs::exists(dir / "runs"));
  }
}

TEST_CASE("a checkpoint of another model is refused before the stage starts") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  REQUIRE(fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--trainer.max_epochs=1"}).exit_code == 0);
  const fs::path ckpt = only_version(dir / "runs") / "checkpoints" / "last.ckpt";
  const ProcessRun run = fulgur_cmd(
      dir.path(), {"test", "--config", "run.toml", "--model=fashion_mnist_cnn", "--ckpt_path=" + ckpt.string()});
  CHECK(run.exit_code == 2);
  FULGUR_CHECK_CONTAINS(run.output, "holds the weights of another model than model 'fashion_mnist_cnn'");
  CHECK(files_in(dir / "runs" / "lightning_logs").size() == 1);  // the test run made no version
}

TEST_CASE("fulgur fit --help lists the options of the plugins, model and data the config selects") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  const ProcessRun run = fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--help"});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  for (const char* needle :
       {"usage: fulgur fit", "[trainer] options", "max_epochs", "model 'fashion_mnist_mlp'", "momentum",
        "datamodule 'fashion_mnist'", "val_split", "callback 'model_checkpoint'", "save_top_k"})
    FULGUR_CHECK_CONTAINS(run.output, needle);
  const ProcessRun plugins = fulgur_cmd(dir.path(), {"plugins", "list"});
  FULGUR_CHECK_CONTAINS(plugins.output, "model        fashion_mnist_mlp");
  FULGUR_CHECK_CONTAINS(plugins.output, "datamodule   fashion_mnist");
}

TEST_CASE("cli_main gives a program with its own classes the same command line") {
  TempDir dir;
  const std::string toml =
      "[trainer]\nmax_epochs = 1\nseed = 3\nlimit_train_batches = 3\nlimit_val_batches = 1\n"
      "enable_progress_bar = false\nenable_model_summary = false\ndefault_root_dir = \"" +
      (dir / "runs").string() + "\"\n[data]\nbatch_size = 8\n[model]\nlr = 0.004\n";
  write_bytes(dir / "own.toml", toml);
  const std::string program = (fs::path(FULGUR_TEST_FASHION_MNIST).parent_path() / "fashion_mnist_cli").string();
  const ProcessRun printed = run_process({program, "fit", "--config", "own.toml", "--print-config"}, kEnv, dir.path());
  REQUIRE_MESSAGE(printed.exit_code == 0, printed.output);
  CHECK(value_in(printed.output, "model", "lr") == "0.004");
  CHECK(value_in(printed.output, "model", "optimizer") == "\"adam\"");  // from the class's hparams_schema
  CHECK(value_in(printed.output, "data", "val_split") == "5000");
  const ProcessRun fit = run_process({program, "fit", "--config", "own.toml"}, kEnv, dir.path());
  REQUIRE_MESSAGE(fit.exit_code == 0, fit.output);
  CHECK(fs::exists(only_version(dir / "runs") / "config.toml"));
  write_bytes(dir / "typo.toml", toml + "momentun = 0.5\n");
  const ProcessRun typo = run_process({program, "fit", "--config", "typo.toml"}, kEnv, dir.path());
  CHECK(typo.exit_code == 2);
  FULGUR_CHECK_CONTAINS(typo.output, "typo.toml:13:12: unknown key 'momentun' for [model]; did you mean 'momentum'?");
}

TEST_CASE("fulgur fit with strategy ddp launches its ranks and rank 0 alone writes the config") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  const ProcessRun run = run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml", "--trainer.strategy=ddp",
                                      "--trainer.devices=2", "--trainer.max_epochs=1"},
                                     {{"FULGUR_LOG_LEVEL", "info"}, {"FULGUR_PLUGIN_PATH", ""}}, dir.path());
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  FULGUR_CHECK_CONTAINS(run.output, "started 2 processes");  // the launcher re-ran `fulgur fit` as rank 1
  const fs::path version = only_version(dir / "runs");       // both ranks share rank 0's log directory
  CHECK(value_in(read_bytes(version / "config.toml"), "trainer", "strategy") == "\"ddp\"");
  CHECK(fs::exists(version / "checkpoints" / "last.ckpt"));
}

TEST_CASE(
    "a mid-epoch checkpoint of 2 processes resumes on 1, dealing out the rest of the epoch: one that does not record "
    "its position in samples is refused, one after the epoch's batches resumes") {
  TempDir dir;
  write_bytes(dir / "run.toml", base_toml(dir.path()));
  // ddp over 2 processes, a checkpoint after 2 of the 4 batches of epoch 0, and last.ckpt after all 4.
  const std::vector<std::string> every_2 = {
      "--callbacks.model_checkpoint.every_n_train_steps=2", "--callbacks.model_checkpoint.save_top_k=-1",
      "--callbacks.model_checkpoint.monitor=", "--callbacks.model_checkpoint.filename={step}",
      "--callbacks.model_checkpoint.dirpath=" + (dir / "ckpts").string()};
  std::vector<std::string> ddp = {
      "fit", "--config", "run.toml", "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_epochs=1"};
  ddp.insert(ddp.end(), every_2.begin(), every_2.end());
  REQUIRE(fulgur_cmd(dir.path(), ddp).exit_code == 0);
  REQUIRE(fs::exists(dir / "ckpts" / "step=2.ckpt"));
  // 2 batches of 32 on each of 2 ranks: 128 of the 55000 training images; the run goes on alone
  // (limit_train_batches = 4 still counts this process's batches).
  const ProcessRun mid = run_process(
      {FULGUR_TEST_FULGUR_BIN, "fit", "--config", "run.toml", "--ckpt_path=" + (dir / "ckpts" / "step=2.ckpt").string(),
       "--callbacks.model_checkpoint.dirpath=" + (dir / "single").string()},
      {{"FULGUR_LOG_LEVEL", "info"}, {"FULGUR_PLUGIN_PATH", ""}}, dir.path());
  REQUIRE_MESSAGE(mid.exit_code == 0, mid.output);
  FULGUR_CHECK_CONTAINS(mid.output,
                        "resumed at step 2 of epoch 0 with 1 processes (was 2); 54872 samples of this epoch remain");
  FULGUR_CHECK_CONTAINS(mid.output, "the global batch is now 32 samples per optimizer step (was 64)");
  CHECK(fs::exists(dir / "single" / "last.ckpt"));
  // The same checkpoint as an older Fulgur wrote it (no position in samples) is refused.
  c10::IValue old = fulgur::read_checkpoint_file((dir / "ckpts" / "step=2.ckpt").string());
  CHECK(
      old.toGenericDict().at("loops").toGenericDict().at("fit_loop").toGenericDict().erase("epoch_samples_consumed") ==
      1);
  fulgur::write_checkpoint_file(old, (dir / "old.ckpt").string());
  const ProcessRun refused =
      fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--ckpt_path=" + (dir / "old.ckpt").string(),
                              "--callbacks.model_checkpoint.dirpath=" + (dir / "refused").string()});
  CHECK(refused.exit_code == 1);
  FULGUR_CHECK_CONTAINS(refused.output,
                        "was written by 2 processes and this run has 1: it stopped 2 batches into epoch 0");
  CHECK_FALSE(fs::exists(dir / "refused" / "last.ckpt"));  // no step was taken
  const ProcessRun end =
      fulgur_cmd(dir.path(), {"fit", "--config", "run.toml", "--ckpt_path=" + (dir / "ckpts" / "last.ckpt").string(),
                              "--callbacks.model_checkpoint.dirpath=" + (dir / "after_end").string()});
  REQUIRE_MESSAGE(end.exit_code == 0, end.output);
  CHECK(fs::exists(dir / "after_end" / "last.ckpt"));  // epoch 1 trained on one process
}
