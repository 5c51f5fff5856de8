// Issue #16: libfulgur_core sets glibc malloc up for training when it is loaded, so that a step's
// freed buffers are reused instead of being returned to the kernel and faulted in again. These
// tests run real processes: the shipped fashion_mnist program on the real data (page faults with
// and without the settings), and a probe program for each documented opt-out.
#include "test_support.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using fulgur::test::contains;
using fulgur::test::TempDir;
namespace fs = std::filesystem;

using Run = fulgur::test::ProcessRun;

Run run(const std::vector<std::string>& args, const std::map<std::string, std::string>& env, const fs::path& dir) {
  return fulgur::test::run_process(args, env, dir);
}

// The caller's own malloc settings must not leak into the runs.
std::map<std::string, std::string> clean_env(std::map<std::string, std::string> extra = {}) {
  std::map<std::string, std::string> env{
      {"FULGUR_HOST_MALLOC", ""}, {"GLIBC_TUNABLES", ""}, {"LD_PRELOAD", ""}, {"FULGUR_LOG_LEVEL", "warn"}};
  for (auto& [k, v] : extra) env[k] = v;
  return env;
}

Run probe(const char* program, std::map<std::string, std::string> env = {}) {
  TempDir dir;
  return run({program}, clean_env(std::move(env)), dir.path());
}

}  // namespace

TEST_CASE("host malloc: tuned by default in any program that links the core, with documented opt-outs") {
  const Run plain = probe(FULGUR_TEST_HOST_MEMORY_PROBE);
  REQUIRE(plain.exit_code == 0);
  CHECK(contains(plain.output, "tuned=1 source=default"));
  CHECK(contains(plain.output, "mmap_threshold 32 MiB, trim_threshold 1024 MiB"));

  // Environment opt-out, for a program the user cannot rebuild.
  CHECK(contains(probe(FULGUR_TEST_HOST_MEMORY_PROBE, {{"FULGUR_HOST_MALLOC", "system"}}).output,
                 "tuned=0 source=FULGUR_HOST_MALLOC"));
  // The user's own glibc tuning of the same knobs is left alone.
  CHECK(
      contains(probe(FULGUR_TEST_HOST_MEMORY_PROBE, {{"GLIBC_TUNABLES", "glibc.malloc.trim_threshold=4194304"}}).output,
               "tuned=0 source=GLIBC_TUNABLES"));
  // Other tunables are not a decision about these two.
  CHECK(contains(probe(FULGUR_TEST_HOST_MEMORY_PROBE, {{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}}).output,
                 "tuned=1 source=default"));
  // A typo is reported and does not silently opt out.
  const Run typo = probe(FULGUR_TEST_HOST_MEMORY_PROBE, {{"FULGUR_HOST_MALLOC", "sytem"}});
  CHECK(contains(typo.output, "FULGUR_HOST_MALLOC = \"sytem\" is not understood"));
  CHECK(contains(typo.output, "tuned=1 source=default"));

  // In the program: FULGUR_HOST_MALLOC("system") at namespace scope; the environment still wins.
  CHECK(contains(probe(FULGUR_TEST_HOST_MEMORY_PROBE_OPT_OUT).output, "tuned=0 source=program"));
  CHECK(contains(probe(FULGUR_TEST_HOST_MEMORY_PROBE_OPT_OUT, {{"FULGUR_HOST_MALLOC", "tuned"}}).output,
                 "tuned=1 source=FULGUR_HOST_MALLOC"));
}

TEST_CASE("host malloc: the example program faults almost no pages per training step, tuned") {
  // Page faults of the training steps alone: a run of `long_run` batches minus a run of
  // `short_run`, so loading libtorch and the data (the same in both) cancels out.
  constexpr int short_run = 5, long_run = 45;
  TempDir dir;
  auto faults = [&](int batches, const char* host_malloc) {
    const fs::path run_dir = dir.path() / (std::string(host_malloc) + std::to_string(batches));
    fs::create_directories(run_dir);
    std::ofstream(run_dir / "job.toml") << "[trainer]\nmax_epochs = 1\nseed = 42\nlimit_train_batches = " << batches
                                        << "\nlimit_val_batches = 2\nlimit_test_batches = 2\n"
                                        << "default_root_dir = \"" << run_dir.string() << "\"\n"
                                        << "[model]\narch = \"cnn\"\n[data]\nbatch_size = 64\n";
    const Run r = run({FULGUR_TEST_FASHION_MNIST, "--config", (run_dir / "job.toml").string()},
                      clean_env({{"FULGUR_HOST_MALLOC", host_malloc}}), run_dir);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    REQUIRE(contains(r.output, "test accuracy"));
    return r.minor_faults;
  };
  const double tuned =
      static_cast<double>(faults(long_run, "tuned") - faults(short_run, "tuned")) / (long_run - short_run);
  const double system =
      static_cast<double>(faults(long_run, "system") - faults(short_run, "system")) / (long_run - short_run);
  MESSAGE("minor page faults per CNN training step: ", tuned, " tuned, ", system, " with glibc's defaults");
  // Tuned: measured 20-120 per step (the difference of two whole runs: ±10 of it is run-to-run
  // noise). glibc's defaults: 3200-3600 per step on most runs, with its adaptive mmap threshold
  // sometimes catching up early and faulting few (a history-dependent outcome, so no comparison is
  // asserted; bench/real.sh reports both). The bound leaves a wide margin and does not depend on timing.
  CHECK(tuned < 500);
}
