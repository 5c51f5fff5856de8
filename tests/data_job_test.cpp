// Process level: a program trains from TOML on an image folder and on a token file through
// fulgur/data with two worker threads, is SIGKILLed mid-epoch, and resumes from last.ckpt to the
// very weights of an uninterrupted run (tests/data_job.cpp; the kill-at-step fixture plugin).
#include <fulgur/checkpoint_io.h>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <csignal>
#include <fstream>

#include "image_files.h"
#include "test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;

c10::impl::GenericDict checkpoint_dict(const fs::path& path) {
  c10::IValue value = fulgur::read_checkpoint_file(path.string());
  REQUIRE(value.isGenericDict());
  return value.toGenericDict();
}

bool same_weights(const fs::path& a, const fs::path& b) {
  const auto wa = checkpoint_dict(a).at("state_dict").toGenericDict();
  const auto wb = checkpoint_dict(b).at("state_dict").toGenericDict();
  if (wa.size() != wb.size() || wa.size() == 0) return false;
  for (const auto& entry : wa) {
    auto other = wb.find(entry.key());
    if (other == wb.end() || !at::equal(entry.value().toTensor(), other->value().toTensor())) return false;
  }
  return true;
}

// 48 samples, batches of 8: 6 steps per epoch, 2 epochs; a checkpoint every 2 steps; optionally
// killed at step 9 (in the second epoch).
std::string job(const fs::path& dir, const fs::path& plugins, const std::string& data, bool kill) {
  std::string toml = fmt::format(
      "[trainer]\nmax_epochs = 2\nseed = 7\nlog_every_n_steps = 2\nenable_progress_bar = false\n"
      "default_root_dir = \"{0}/runs\"\nckpt_path = \"last\"\n"
      "[data]\n{1}batch_size = 8\nnum_workers = 2\nseed = 3\n"
      "[plugins]\npaths = [\"{2}\"]\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"{0}/ckpt\"\nevery_n_train_steps = 2\n"
      "save_top_k = 0\nsave_last = true\n",
      dir.string(), data, plugins.string());
  if (kill)
    toml +=
        fmt::format("[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = 9\nmarker = \"{}/killed\"\n", dir.string());
  return toml;
}

void check_resume_is_exact(const std::string& data) {
  TempDir dir;
  const fs::path plugins = dir.subdir("plugins");
  fulgur::test::copy_library(fulgur::test::fixture("libfulgur-fixture-kill-at-step.so"),
                             plugins / "libfulgur-fixture-kill-at-step.so");
  auto run = [&](const fs::path& at, bool kill) {
    std::ofstream(at / "job.toml") << job(at, plugins, data, kill);
    // Built into the same directory as fulgur_ddp_worker (tests/CMakeLists.txt).
    const fs::path program = fs::path(FULGUR_TEST_DDP_WORKER).parent_path() / "fulgur_data_job";
    return fulgur::test::run_process({program.string(), (at / "job.toml").string()}, {{"FULGUR_LOG_LEVEL", "info"}},
                                     at);
  };
  const fs::path reference = dir.subdir("reference"), job_dir = dir.subdir("job");
  const ProcessRun full = run(reference, false);
  INFO(full.output);
  REQUIRE(full.exit_code == 0);
  CHECK(checkpoint_dict(reference / "ckpt" / "last.ckpt").at("global_step").toInt() == 12);

  const ProcessRun killed = run(job_dir, true);
  INFO(killed.output);
  REQUIRE(killed.exit_code == -SIGKILL);
  const int64_t saved = checkpoint_dict(job_dir / "ckpt" / "last.ckpt").at("global_step").toInt();
  CHECK(saved > 6);
  CHECK(saved % 6 != 0);  // mid-epoch: the resume skips batches of the second epoch
  const ProcessRun resumed = run(job_dir, false);
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.output, "batches into the epoch"));
  CHECK(same_weights(job_dir / "ckpt" / "last.ckpt", reference / "ckpt" / "last.ckpt"));
}

}  // namespace

TEST_CASE("data job: an image-folder run with 2 workers killed mid-epoch resumes bit for bit") {
  TempDir images;
  for (int c = 0; c < 3; ++c) {
    const fs::path cls = images.subdir(fmt::format("class{}", c));
    for (int i = 0; i < 16; ++i)
      fulgur::test::write_png(cls / fmt::format("{:02d}.png", i), fulgur::test::pattern_image(20, 20, c * 40 + i));
  }
  check_resume_is_exact(fmt::format("format = \"image_folder\"\npath = \"{}\"\n", images.path().string()));
}

TEST_CASE("data job: a token-file run with 2 workers killed mid-epoch resumes bit for bit") {
  TempDir tokens;
  std::vector<uint16_t> ids(8 * 48 + 1);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint16_t>((i * 7 + i / 5) % 64);
  fulgur::test::write_bytes(tokens / "train.bin",
                            std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 2));
  check_resume_is_exact(fmt::format("format = \"token_file\"\npath = \"{}\"\n", (tokens / "train.bin").string()));
}
