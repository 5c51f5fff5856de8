// Contract v2 (issue #11), shown the way a user meets it: the shipped fashion_mnist program, driven
// by TOML files, on the real data, with third-party plugins (tests/fixtures/contract_fixtures.cpp)
// dropped into a plugin directory. Each test runs real processes and checks files on disk.
#include "test_support.h"

#include <fulgur/checkpoint_io.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/equal.h>
#include <dirent.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;
namespace fs = std::filesystem;

// The fixtures a test needs, copied into a private plugin directory (the fixture build directory
// also holds deliberately broken plugins, which have no business in these runs).
fs::path plugin_dir(const TempDir& dir, std::initializer_list<const char*> fixtures) {
  const fs::path plugins = dir.subdir("plugins");
  for (const char* name : fixtures) {
    const std::string file = std::string("libfulgur-fixture-") + name + ".so";
    fulgur::test::copy_library(fulgur::test::fixture(file), plugins / file);
  }
  return plugins;
}

// A small, quick configuration of the example: the MLP, 20 training batches of 32 per epoch, data
// loaded by two worker threads. `extra` is appended (more tables).
std::string job_toml(const fs::path& root, const fs::path& plugins, int max_epochs, const std::string& trainer_extra,
                     const std::string& extra) {
  return "[trainer]\nmax_epochs = " + std::to_string(max_epochs) +
         "\nseed = 7\nlimit_train_batches = 20\nlimit_val_batches = 3\nlimit_test_batches = 2\n"
         "log_every_n_steps = 5\nenable_progress_bar = false\ndefault_root_dir = \"" +
         (root / "runs").string() + "\"\n" + trainer_extra + "[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\n" +
         "num_workers = 2\n[plugins]\npaths = [\"" + plugins.string() + "\"]\n" + extra;
}

ProcessRun run_example(const fs::path& toml, const fs::path& dir) {
  return fulgur::test::run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml.string()},
                                   {{"FULGUR_LOG_LEVEL", "info"}}, dir);
}

c10::impl::GenericDict checkpoint_dict(const fs::path& path) {
  c10::IValue value = fulgur::read_checkpoint_file(path.string());
  REQUIRE(value.isGenericDict());
  return value.toGenericDict();
}

// True when both checkpoints hold the same model tensors, bit for bit.
bool same_weights(const fs::path& a, const fs::path& b) {
  const auto wa = checkpoint_dict(a).at("state_dict").toGenericDict();
  const auto wb = checkpoint_dict(b).at("state_dict").toGenericDict();
  if (wa.size() != wb.size()) return false;
  for (const auto& entry : wa) {
    auto other = wb.find(entry.key());
    if (other == wb.end()) return false;
    if (!at::equal(entry.value().toTensor(), other->value().toTensor())) return false;
  }
  return true;
}

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("contract v2: ckpt_path = \"last\" resumes a run killed mid-epoch, bit for bit") {
  TempDir dir;
  const fs::path plugins = plugin_dir(dir, {"kill-at-step"});
  const std::string checkpointing = "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" +
                                    (dir / "ckpt").string() +
                                    "\"\nevery_n_train_steps = 4\nsave_top_k = 0\nsave_last = true\n";
  const std::string resume = "ckpt_path = \"last\"\n";

  // The uninterrupted reference, from the same settings (its first start finds no last.ckpt).
  const fs::path reference_dir = dir.subdir("reference");
  std::ofstream(reference_dir / "job.toml")
      << job_toml(reference_dir, plugins, 2, resume,
                  "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" + (reference_dir / "ckpt").string() +
                      "\"\nevery_n_train_steps = 4\nsave_top_k = 0\n"
                      "save_last = true\n");
  const ProcessRun reference = run_example(reference_dir / "job.toml", reference_dir);
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);
  CHECK(contains(reference.output, "no last checkpoint exists yet"));

  // The same job, killed by SIGKILL after step 13 (last.ckpt holds step 12, 12 batches into the
  // first epoch), then started again with the very same TOML.
  std::ofstream(dir / "job.toml") << job_toml(dir.path(), plugins, 2, resume,
                                              checkpointing +
                                                  "[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = "
                                                  "13\nmarker = \"" +
                                                  (dir / "killed").string() + "\"\n");
  const ProcessRun killed = run_example(dir / "job.toml", dir.path());
  INFO(killed.output);
  REQUIRE(killed.exit_code == -SIGKILL);
  REQUIRE(fs::exists(dir / "killed"));
  CHECK(checkpoint_dict(dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 12);

  const ProcessRun resumed = run_example(dir / "job.toml", dir.path());
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.output, "Restored training state from " + (dir / "ckpt" / "last.ckpt").string() +
                                     " (epoch 0, global step 12, 12 batches into the epoch)"));
  CHECK(checkpoint_dict(dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 40);
  CHECK(same_weights(dir / "ckpt" / "last.ckpt", reference_dir / "ckpt" / "last.ckpt"));
}

TEST_CASE("contract v2: a third-party checkpoint callback serves ckpt_path = \"best\"") {
  TempDir dir;
  const fs::path plugins = plugin_dir(dir, {"best-keeper"});
  const std::string keeper =
      "[[callbacks]]\nname = \"fixture_best_keeper\"\ndir = \"" + (dir / "keep").string() + "\"\n";
  std::ofstream(dir / "first.toml") << job_toml(dir.path(), plugins, 3, "", keeper);
  const ProcessRun first = run_example(dir / "first.toml", dir.path());
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  const std::vector<std::string> saved = files_in(dir / "keep");
  REQUIRE(saved.size() == 3);  // one per validation, no model_checkpoint anywhere
  // The lowest val/loss among them, read from the names as the fixture wrote them.
  std::string best;
  double best_score = 1e300;
  for (const auto& name : saved) {
    long long step = 0;
    double score = 0;
    REQUIRE(std::sscanf(name.c_str(), "keeper-step=%lld-score=%lf.ckpt", &step, &score) == 2);
    if (score < best_score) best_score = score, best = name;
  }

  // A new process: the core asks the provider, which finds the best file on disk.
  std::ofstream(dir / "second.toml") << job_toml(dir.path(), plugins, 4, "ckpt_path = \"best\"\n", keeper);
  const ProcessRun second = run_example(dir / "second.toml", dir.path());
  INFO(second.output);
  REQUIRE(second.exit_code == 0);
  CHECK(contains(second.output, "Restored training state from " + (dir / "keep" / best).string()));
}

TEST_CASE("contract v2: a plugin that throws is named with its file, hook, epoch and step, and nothing saved is lost") {
  TempDir dir;
  const fs::path plugins = plugin_dir(dir, {"thrower", "status-logger"});
  std::ofstream(dir / "job.toml") << job_toml(
      dir.path(), plugins, 2, "",
      "[[loggers]]\nname = \"fixture_status_logger\"\nfile = \"" + (dir / "status.txt").string() +
          "\"\n[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" + (dir / "ckpt").string() +
          "\"\nevery_n_train_steps = 3\nsave_top_k = 0\nsave_last = true\n[[callbacks]]\nname = "
          "\"fixture_thrower\"\nstep = 7\n");
  const ProcessRun run = run_example(dir / "job.toml", dir.path());
  INFO(run.output);
  CHECK(run.exit_code == 1);
  FULGUR_CHECK_CONTAINS(run.output, "callback 'fixture_thrower'");
  FULGUR_CHECK_CONTAINS(run.output, (plugins / "libfulgur-fixture-thrower.so").string());
  FULGUR_CHECK_CONTAINS(run.output, "on_train_batch_end at epoch 0, global step 7");
  FULGUR_CHECK_CONTAINS(run.output, "the fixture gave up on purpose");
  CHECK(!contains(run.output, "internal error"));
  // The loggers were told the run failed.
  std::ifstream status(dir / "status.txt");
  std::string line;
  REQUIRE(std::getline(status, line));
  CHECK(line == "failed");
  // The last checkpoint written before the failure (step 6) is complete and loads.
  CHECK(checkpoint_dict(dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 6);
  CHECK(files_in(dir / "ckpt") == std::vector<std::string>{"last.ckpt"});  // no partial temp file left
}

TEST_CASE("contract v2: core/ and registry/ name no built-in plugin, only the build's generated list does") {
  // The built-in and reserved names, as plugins/CMakeLists.txt declares them.
  const fs::path source(FULGUR_TEST_SOURCE_DIR);
  std::ifstream cmake(source / "plugins" / "CMakeLists.txt");
  std::vector<std::string> names;
  for (std::string line; std::getline(cmake, line);) {
    for (const char* call : {"fulgur_builtin_plugin(", "fulgur_reserve_plugin_name("}) {
      if (line.rfind(call, 0) != 0) continue;
      std::istringstream words(line.substr(std::string(call).size()));
      std::string kind, name;
      words >> kind >> name;
      if (!name.empty() && name.back() == ')') name.pop_back();
      names.push_back(name);
    }
  }
  REQUIRE(names.size() >= 20);
  REQUIRE(std::find(names.begin(), names.end(), "model_checkpoint") != names.end());

  // Any quoted occurrence in code (comments, which document examples, are left out).
  std::vector<std::string> found;
  for (const char* tree : {"core", "registry"}) {
    for (const auto& entry : fs::recursive_directory_iterator(source / tree)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".txt")) continue;
      std::ifstream in(entry.path());
      int number = 0;
      for (std::string line; std::getline(in, line);) {
        ++number;
        const size_t comment = line.find(ext == ".txt" ? "#" : "//");
        const std::string code = line.substr(0, comment);
        for (const std::string& name : names)
          for (const std::string& quoted : {"\"" + name + "\"", "'" + name + "'", "\\\"" + name + "\\\""})
            if (code.find(quoted) != std::string::npos)
              found.push_back(fmt::format("{}:{}: {}", fs::relative(entry.path(), source).string(), number, line));
      }
    }
  }
  INFO(fmt::format("{}", fmt::join(found, "\n")));
  CHECK(found.empty());
}

TEST_CASE("every test case name survives CTest: no semicolon (CTest cuts the name there and then runs nothing)") {
  // doctest_discover_tests makes each TEST_CASE a CTest test by its name; a ';' splits it into a
  // list, the test filters match no case, and the "test" passes without running (three did).
  std::vector<std::string> bad;
  for (const auto& entry : fs::directory_iterator(fs::path(FULGUR_TEST_SOURCE_DIR) / "tests")) {
    if (entry.path().extension() != ".cpp") continue;
    std::ifstream in(entry.path());
    int number = 0;
    // The name is the first string after TEST_CASE(, on its line or (clang-format's wrap) the next.
    bool name_next = false;
    for (std::string line; std::getline(in, line);) {
      ++number;
      size_t at = line.find_first_not_of(" \t");
      if (at != std::string::npos && line.compare(at, 10, "TEST_CASE(") == 0)
        at += 10;
      else if (name_next)
        at = 0;
      else
        at = std::string::npos;
      name_next = false;
      if (at == std::string::npos) continue;
      const size_t open = line.find('"', at);
      if (open == std::string::npos) {
        name_next = line.find_first_not_of(" \t", at) == std::string::npos;
        continue;
      }
      const size_t end = line.find('"', open + 1);
      if (line.substr(open + 1, end - open - 1).find(';') != std::string::npos)
        bad.push_back(fmt::format("{}:{}", entry.path().filename().string(), number));
    }
  }
  INFO(fmt::format("{}", fmt::join(bad, ", ")));
  CHECK(bad.empty());
}

TEST_CASE("contract v2: fulgur config check rejects bad values of [trainer] keys and of plugin options") {
  TempDir dir;
  auto check = [&](const std::string& toml) {
    std::ofstream(dir / "job.toml") << toml;
    return fulgur::test::run_process({FULGUR_TEST_FULGUR_BIN, "config", "check", (dir / "job.toml").string()},
                                     {{"FULGUR_LOG_LEVEL", "warn"}}, dir.path());
  };
  const ProcessRun good = check(
      "[trainer]\nmax_epochs = 2\n[[callbacks]]\nname = \"early_stopping\"\n"
      "monitor = \"val/loss\"\nmode = \"max\"\n");
  INFO(good.output);
  CHECK(good.exit_code == 0);
  CHECK(contains(good.output, "config OK"));

  // A [trainer] value the Trainer would refuse, found before any training, with its place.
  const ProcessRun trainer_value = check("[trainer]\nmax_epochs = 2\naccumulate_grad_batches = 0\n");
  CHECK(trainer_value.exit_code != 0);
  FULGUR_CHECK_CONTAINS(trainer_value.output, "job.toml:3");
  FULGUR_CHECK_CONTAINS(trainer_value.output, "accumulate_grad_batches = 0: must be >= 1");
  CHECK(!contains(trainer_value.output, "config OK"));

  // A plugin option of the right type but a value its constructor refuses.
  const ProcessRun plugin_value = check(
      "[trainer]\nmax_epochs = 2\n[[callbacks]]\nname = \"early_stopping\"\nmonitor = \"val/loss\"\n"
      "mode = \"sideways\"\n");
  CHECK(plugin_value.exit_code != 0);
  FULGUR_CHECK_CONTAINS(plugin_value.output, "job.toml:4");  // the table's name = line
  FULGUR_CHECK_CONTAINS(plugin_value.output, "mode = \"sideways\" is not understood");
}

TEST_CASE(
    "contract v2: a callback overriding a hook it does not declare is warned about, declared conditions are not") {
  TempDir dir;
  const fs::path plugins = plugin_dir(dir, {"undeclared"});
  // The shipped CLI creates it (`fulgur plugins load` runs its factory).
  auto describe = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv{FULGUR_TEST_FULGUR_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    return fulgur::test::run_process(argv, {{"FULGUR_PLUGIN_PATH", plugins.string()}, {"FULGUR_LOG_LEVEL", "info"}},
                                     dir.path());
  };
  const ProcessRun warned = describe({"plugins", "load", "fixture_undeclared", "--kind", "callback"});
  INFO(warned.output);
  FULGUR_CHECK_CONTAINS(warned.output, "on_train_start but does not list them in hooks()");
  // model_checkpoint leaves on_train_batch_end out when it saves by epoch only: intended, no warning.
  const ProcessRun quiet = describe({"plugins", "load", "model_checkpoint", "--kind", "callback"});
  INFO(quiet.output);
  CHECK(quiet.exit_code == 0);
  CHECK(!contains(quiet.output, "does not list them in hooks()"));
}
