// SDK 1.1, what it added without changing a frozen vtable or layout (CHANGELOG.md):
// - typed plugin options: a FULGUR_OPTIONS struct is the schema and what the constructor reads;
// - the CheckpointObserver extension of Logger: a logger hears of every checkpoint the run writes.
// Both through plugins built as a third party builds them (tests/fixtures/sdk11_fixtures.cpp),
// loaded by the shipped executables from TOML. The SDK 1.0 corpus (abi_corpus_test.cpp) proves
// that plugins built before these additions still load and train.
#include <fulgur/abi.h>
#include <fulgur/callback.h>
#include <fulgur/registry/registry.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.h"
#include "training_job.h"

namespace {

namespace fs = std::filesystem;
namespace job = fulgur::test::job;
using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;

// `fulgur <args>` with the typed-options fixture in the plugin path.
ProcessRun fulgur_cli(const TempDir& dir, std::vector<std::string> args) {
  args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
  return fulgur::test::run_process(args, {{"FULGUR_LOG_LEVEL", "warn"}}, dir.path());
}

}  // namespace

TEST_CASE("SDK 1.1 typed options: declared once as a struct, read typed, errors name plugin, option and value") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"typed-options"});

  // The schema is the struct's: `plugins describe` lists every member with its type and default,
  // and the plugin records SDK 1.1.
  std::ofstream(dir / "paths.toml") << "[plugins]\npaths = [\"" << plugins.string() << "\"]\n";
  const ProcessRun described =
      fulgur_cli(dir, {"plugins", "describe", "fixture_typed_options", "--config", (dir / "paths.toml").string()});
  INFO(described.output);
  REQUIRE(described.exit_code == 0);
  for (const char* expected : {"greeting", "(required)", "repeat", "3", "scale", "0.5", "loud", "false", "names",
                               "\"ann\"", "\"bob\"", "weights"})
    FULGUR_CHECK_CONTAINS(described.output, expected);
  FULGUR_CHECK_CONTAINS(described.output, fmt::format("{}.{}", FULGUR_SDK_VERSION_MAJOR, FULGUR_SDK_VERSION_MINOR));

  // Created by the host from a table: the members hold the table's values, defaults for the rest.
  fulgur::PluginRegistry registry(std::vector<fulgur::SearchDirectory>{{plugins, "config"}});
  const auto& metadata = registry.resolve(fulgur::PluginKind::callback, "fixture_typed_options").metadata;
  fulgur::Options given("callback 'fixture_typed_options'");
  for (const fulgur::OptionSchema& spec : metadata.options)
    if (spec.default_value) given.set(spec.key, *spec.default_value);
  given.set("greeting", std::string("hi")).set("repeat", int64_t{2}).set("weights", std::vector<double>{1.0, 2.0});
  auto callback = fulgur::plugin_cast<fulgur::Callback>(
      registry.create(fulgur::PluginKind::callback, "fixture_typed_options", given));
  CHECK(callback->state_key() ==
        "greeting=hi repeat=2 scale=0.5 loud=false names=[ann, bob] weights=[1, 2] "
        "owner=callback 'fixture_typed_options'");

  // What the plugin refuses is worded by the SDK: owner, option, the value as given, why.
  auto config_check = [&](const std::string& table) {
    std::ofstream(dir / "run.toml") << "[trainer]\nmax_epochs = 1\n[plugins]\npaths = [\"" << plugins.string()
                                    << "\"]\n[[callbacks]]\nname = \"fixture_typed_options\"\n"
                                    << table;
    return fulgur_cli(dir, {"config", "check", (dir / "run.toml").string()});
  };
  CHECK(config_check("greeting = \"hi\"\n").exit_code == 0);
  const std::vector<std::pair<std::string, std::string>> refused{
      {"greeting = \"hi\"\nrepeat = -1\n", "callback 'fixture_typed_options': repeat = -1 must be >= 0"},
      {"greeting = \"hi\"\nscale = 1.5\n", "callback 'fixture_typed_options': scale = 1.5 is outside [0, 1]"},
      {"greeting = \"hi\"\nweights = [0.5]\n",
       "callback 'fixture_typed_options': weights = [0.5] has 1 entries for 2 names"},
      {"repeat = 1\n", "greeting"},                          // required, from the struct's schema
      {"greeting = 3\n", "greeting"},                        // the member's type is the schema's
      {"greeting = \"hi\"\ngreting = \"x\"\n", "greting"}};  // unknown key, with a suggestion
  for (const auto& [table, message] : refused) {
    const ProcessRun run = config_check(table);
    INFO(table << run.output);
    CHECK(run.exit_code != 0);
    FULGUR_CHECK_CONTAINS(run.output, message);
  }
}

TEST_CASE("SDK 1.1 CheckpointObserver: a logger hears of every checkpoint the run writes, complete on disk") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"checkpoint-observer"});
  const fs::path observed = dir / "observed.txt";
  const fs::path checkpoints = dir / "ckpts";
  // 3 epochs of 8 steps, a checkpoint every 4 steps keeping only the newest (save_top_k = 1, no
  // monitor), and last.ckpt each time: 6 step files are written and 5 of them deleted again.
  std::ofstream(dir / "job.toml") << job::toml(
      dir.path(), plugins, 3, 8, "",
      fmt::format("[[loggers]]\nname = \"fixture_checkpoint_observer\"\nfile = \"{}\"\n"
                  "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"{}\"\nevery_n_train_steps = 4\n"
                  "save_top_k = 1\nsave_last = true\n",
                  observed.string(), checkpoints.string()));
  const ProcessRun run = job::run_example(dir / "job.toml", dir.path());
  INFO(run.output);
  REQUIRE(run.exit_code == 0);

  std::ifstream in(observed);
  REQUIRE(in.good());
  const std::regex line_pattern(R"(rank=0 step=(\d+) epoch=(\d+) weights_only=false exists=true (.*))");
  std::set<std::string> step_files, all_files;
  int64_t previous_step = 0;
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    std::smatch m;
    INFO(line);
    REQUIRE(std::regex_match(line, m, line_pattern));
    const int64_t step = std::stoll(m[1]), epoch = std::stoll(m[2]);
    const fs::path path = m[3].str();
    CHECK(path.parent_path() == checkpoints);
    CHECK(step >= previous_step);  // in the order they were written
    previous_step = step;
    all_files.insert(path.filename().string());
    if (path.filename() != "last.ckpt") {
      // The file's own name says its epoch and step (model_checkpoint's default filename).
      CHECK(path.filename().string() == fmt::format("epoch={}-step={}.ckpt", epoch, step));
      step_files.insert(path.filename().string());
    }
  }
  CHECK(step_files == std::set<std::string>{"epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "epoch=1-step=12.ckpt",
                                            "epoch=1-step=16.ckpt", "epoch=2-step=20.ckpt", "epoch=2-step=24.ckpt"});
  CHECK(all_files.contains("last.ckpt"));
  CHECK(lines == 12);  // each step file and last.ckpt with it
  // What stayed on disk was all observed; what was observed and is gone, model_checkpoint deleted.
  for (const std::string& name : job::files_in(checkpoints)) CHECK_MESSAGE(all_files.contains(name), name);
  CHECK(job::files_in(checkpoints).size() == 2);
}
