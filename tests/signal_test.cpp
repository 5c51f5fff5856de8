// Signals and crashes (issue #17, items 2 and 5), shown the way a user meets them: the shipped
// fashion_mnist program driven by TOML files in real processes, signalled by a fixture plugin
// (tests/fixtures/signal_fixtures.cpp) at a known step or by this test from outside, and the
// on_exception_checkpoint callback. Each test checks exit statuses, output and files on disk.
#include "training_job.h"

#include <fulgur/testing.h>
#include <fulgur/testing/plugin_kit.h>

#include <doctest/doctest.h>

#include <csignal>
#include <fstream>
#include <string>

namespace {

using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;
namespace fs = std::filesystem;
namespace job = fulgur::test::job;

std::string first_line(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string signal_at(int step, const std::string& signal, const fs::path& marker, int rank = -1) {
  return "[[callbacks]]\nname = \"fixture_signal_at_step\"\nstep = " + std::to_string(step) + "\nsignal = \"" + signal +
         "\"\nmarker = \"" + marker.string() + "\"\nrank = " + std::to_string(rank) + "\n";
}

std::string status_logger(const fs::path& file) {
  return "[[loggers]]\nname = \"fixture_status_logger\"\nfile = \"" + file.string() + "\"\n";
}

// The uninterrupted run every resumed one must match: 2 epochs of 20 batches, last.ckpt every 4 steps.
fs::path reference_run(const TempDir& dir, const fs::path& plugins) {
  const fs::path ref = dir.subdir("reference");
  std::ofstream(ref / "job.toml") << job::toml(ref, plugins, 2, 20, "", job::checkpointing(ref / "ckpt", 4));
  const ProcessRun run = job::run_example(ref / "job.toml", ref);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  return ref / "ckpt" / "last.ckpt";
}

}  // namespace

TEST_CASE(
    "signals: SIGTERM mid-epoch saves at the next step, exits 143, and ckpt_path = \"last\" resumes bit for bit") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step", "status-logger"});
  const fs::path reference = reference_run(dir, plugins);

  // SIGTERM arrives during step 13's on_train_batch_end (13 batches into the first epoch); last.ckpt
  // holds step 12, the interruption checkpoint step 13, and is the newer of the two.
  std::ofstream(dir / "job.toml") << job::toml(dir.path(), plugins, 2, 20, "ckpt_path = \"last\"\n",
                                               job::checkpointing(dir / "ckpt", 4) +
                                                   signal_at(13, "SIGTERM", dir / "signalled") +
                                                   status_logger(dir / "status.txt"));
  const ProcessRun stopped = job::run_example(dir / "job.toml", dir.path());
  INFO(stopped.output);
  REQUIRE(stopped.exit_code == 143);
  FULGUR_CHECK_CONTAINS(stopped.output, "fulgur: SIGTERM received: stopping after the current step");
  FULGUR_CHECK_CONTAINS(stopped.output, "exiting with status 143");
  CHECK(!contains(stopped.output, "test accuracy"));  // fit did not return: the program stopped there
  const fs::path interrupted = dir / "runs" / "interrupted.ckpt";
  REQUIRE(fs::exists(interrupted));
  CHECK(job::checkpoint_dict(interrupted).at("global_step").toInt() == 13);
  CHECK(job::checkpoint_dict(dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 12);
  CHECK(first_line(dir / "status.txt") == "interrupted");

  const ProcessRun resumed = job::run_example(dir / "job.toml", dir.path());
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  FULGUR_CHECK_CONTAINS(resumed.output, "Restored training state from " + interrupted.string() +
                                            " (epoch 0, global step 13, 13 batches into the epoch)");
  CHECK(job::checkpoint_dict(dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 40);
  CHECK(job::same_weights(dir / "ckpt" / "last.ckpt", reference));
}

TEST_CASE("signals: a SIGTERM or SIGINT sent from outside stops the run with a checkpoint (143, 130)") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  for (const auto& [sig, code] : {std::pair{SIGTERM, 143}, std::pair{SIGINT, 130}}) {
    INFO("signal " << sig);
    const fs::path run_dir = dir.subdir("run" + std::to_string(sig));
    // The fixture writes its marker at step 6, then waits in the hook for this test's signal.
    std::ofstream(run_dir / "job.toml") << job::toml(run_dir, plugins, 1, 20, "",
                                                     signal_at(6, "", run_dir / "waiting"));
    job::BackgroundProcess process({FULGUR_TEST_FASHION_MNIST, "--config", (run_dir / "job.toml").string()},
                                   {{"FULGUR_LOG_LEVEL", "info"}}, run_dir);
    REQUIRE(process.wait_for_file(run_dir / "waiting"));
    REQUIRE(::kill(process.pid(), sig) == 0);
    const ProcessRun run = process.wait();
    INFO(run.output);
    CHECK(run.exit_code == code);
    const fs::path checkpoint = run_dir / "runs" / "interrupted.ckpt";
    REQUIRE(fs::exists(checkpoint));
    // Linux hands a process-directed signal to the main thread when it can take it (it waits in
    // the fixture's hook), so this is step 6; any later step would be as correct.
    const int64_t step = job::checkpoint_dict(checkpoint).at("global_step").toInt();
    CHECK(step >= 6);
    CHECK(step < 20);
  }
}

TEST_CASE("signals: interrupt_checkpoint = \"\" leaves SIGTERM its default action") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  std::ofstream(dir / "job.toml") << job::toml(dir.path(), plugins, 1, 20, "interrupt_checkpoint = \"\"\n",
                                               signal_at(5, "SIGTERM", dir / "signalled"));
  const ProcessRun run = job::run_example(dir / "job.toml", dir.path());
  INFO(run.output);
  CHECK(run.exit_code == -SIGTERM);
  CHECK(!fs::exists(dir / "runs" / "interrupted.ckpt"));
}

TEST_CASE("signals: under SLURM the requeue signal checkpoints, runs scontrol requeue, and the requeued job resumes") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  const fs::path reference = reference_run(dir, plugins);

  // A fake scontrol on PATH that records its arguments.
  const fs::path bin = dir.subdir("bin");
  std::ofstream(bin / "scontrol") << "#!/bin/sh\necho \"$@\" >> \"" << (dir / "scontrol-calls.txt").string() << "\"\n";
  fs::permissions(bin / "scontrol", fs::perms(0755));
  const std::map<std::string, std::string> slurm = {{"SLURM_JOB_ID", "4242"},
                                                    {"PATH", bin.string() + ":" + std::getenv("PATH")}};

  // No ckpt_path: the requeued job finds its checkpoint because SLURM tells it it was restarted.
  std::ofstream(dir / "job.toml") << job::toml(
      dir.path(), plugins, 2, 20, "", job::checkpointing(dir / "ckpt", 4) + signal_at(9, "SIGUSR1", dir / "signalled"));
  const ProcessRun requeued = job::run_example(dir / "job.toml", dir.path(), slurm);
  INFO(requeued.output);
  REQUIRE(requeued.exit_code == 128 + SIGUSR1);
  CHECK(first_line(dir / "scontrol-calls.txt") == "requeue 4242");
  FULGUR_CHECK_CONTAINS(requeued.output, "requeued SLURM job 4242");
  const fs::path interrupted = dir / "runs" / "interrupted.ckpt";
  CHECK(job::checkpoint_dict(interrupted).at("global_step").toInt() == 9);

  auto restarted_env = slurm;
  restarted_env["SLURM_RESTART_COUNT"] = "1";
  const ProcessRun resumed = job::run_example(dir / "job.toml", dir.path(), restarted_env);
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  FULGUR_CHECK_CONTAINS(resumed.output, "SLURM_RESTART_COUNT = 1: this job was restarted");
  FULGUR_CHECK_CONTAINS(resumed.output, "Restored training state from " + interrupted.string() +
                                            " (epoch 0, global step 9, 9 batches into the epoch)");
  CHECK(job::same_weights(dir / "ckpt" / "last.ckpt", reference));
  // Outside SLURM, SIGUSR1 is left alone (Lightning installs its requeue handler only in a job).
}

TEST_CASE("signals: SIGTERM to one rank of a 2-process ddp run stops both at the same step with one checkpoint") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  const std::string ddp = "strategy = \"ddp\"\ndevices = 2\n";
  const fs::path ref = dir.subdir("reference");
  std::ofstream(ref / "job.toml") << job::toml(ref, plugins, 1, 16, ddp, job::checkpointing(ref / "ckpt", 4));
  const ProcessRun reference = job::run_example(ref / "job.toml", ref);
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);

  // Only rank 1 (a child of Fulgur's launcher) receives SIGTERM, at step 5. The ranks vote one
  // batch behind (SignalVote): the vote started after step 5 is read after step 6, so both save
  // step 6 and both exit 143 (the launcher's status too).
  std::ofstream(dir / "job.toml") << job::toml(
      dir.path(), plugins, 1, 16, ddp + "ckpt_path = \"last\"\n",
      job::checkpointing(dir / "ckpt", 4) + signal_at(5, "SIGTERM", dir / "signalled", /*rank=*/1));
  const ProcessRun stopped = job::run_example(dir / "job.toml", dir.path());
  INFO(stopped.output);
  REQUIRE(stopped.exit_code == 143);
  CHECK(fs::exists(dir / "signalled.1"));
  CHECK(!contains(stopped.output, "[fulgur launcher] rank 1"));  // its 143 is no failure
  const fs::path interrupted = dir / "runs" / "interrupted.ckpt";
  REQUIRE(fs::exists(interrupted));
  CHECK(job::checkpoint_dict(interrupted).at("global_step").toInt() == 6);

  const ProcessRun resumed = job::run_example(dir / "job.toml", dir.path());
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  FULGUR_CHECK_CONTAINS(resumed.output, "Restored training state from " + interrupted.string());
  CHECK(job::same_weights(dir / "ckpt" / "last.ckpt", ref / "ckpt" / "last.ckpt"));
}

TEST_CASE("signals: FULGUR_SIGNAL_VOTE_EVERY = 3 still stops both ranks of a ddp run, at the documented step") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  const std::string ddp = "strategy = \"ddp\"\ndevices = 2\n";
  // Rank 1 receives SIGTERM at step 5. Votes start after steps 3, 6, 9, ... and each is read when
  // the next starts: the one started after step 3 (no signal yet) is read after step 6, the one
  // started after step 6 (rank 1 has the signal) after step 9: both ranks save step 9, within the
  // documented 2N = 6 batches of the signal.
  std::ofstream(dir / "job.toml") << job::toml(dir.path(), plugins, 1, 16, ddp,
                                               signal_at(5, "SIGTERM", dir / "signalled", /*rank=*/1));
  const ProcessRun stopped = job::run_example(dir / "job.toml", dir.path(), {{"FULGUR_SIGNAL_VOTE_EVERY", "3"}});
  INFO(stopped.output);
  REQUIRE(stopped.exit_code == 143);
  CHECK(fs::exists(dir / "signalled.1"));
  CHECK(!contains(stopped.output, "[fulgur launcher] rank 1"));
  const fs::path interrupted = dir / "runs" / "interrupted.ckpt";
  REQUIRE(fs::exists(interrupted));
  CHECK(job::checkpoint_dict(interrupted).at("global_step").toInt() == 9);

  // A value that is not a number is refused, named.
  const ProcessRun bad = job::run_example(dir / "job.toml", dir.path(), {{"FULGUR_SIGNAL_VOTE_EVERY", "often"}});
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output, "FULGUR_SIGNAL_VOTE_EVERY = 'often'");
}

TEST_CASE(
    "signals: under fsdp with sharded checkpoints, SIGTERM to one rank saves one checkpoint directory and "
    "ckpt_path = \"last\" resumes from it bit for bit") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  const std::string fsdp = "strategy = \"fsdp\"\ndevices = 2\n";
  // The MLP runs no fulgur::run_block blocks: its parameters stay whole, accepted explicitly.
  const std::string sharded =
      "[strategy]\nzero_stage = 3\nstate_dict_type = \"sharded\"\nauto_wrap_policy = \"root\"\n";
  const fs::path ref = dir.subdir("reference");
  std::ofstream(ref / "job.toml") << job::toml(ref, plugins, 1, 16, fsdp,
                                               job::checkpointing(ref / "ckpt", 4) + sharded);
  const ProcessRun reference = job::run_example(ref / "job.toml", ref);
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);

  std::ofstream(dir / "job.toml") << job::toml(
      dir.path(), plugins, 1, 16, fsdp + "ckpt_path = \"last\"\n",
      job::checkpointing(dir / "ckpt", 4) + signal_at(5, "SIGTERM", dir / "signalled", /*rank=*/1) + sharded);
  const ProcessRun stopped = job::run_example(dir / "job.toml", dir.path());
  INFO(stopped.output);
  REQUIRE(stopped.exit_code == 143);
  // A directory each rank wrote its rows into, newer than last.ckpt (step 4): "last" picks it.
  const fs::path interrupted = dir / "runs" / "interrupted.ckpt";
  REQUIRE(fs::is_directory(interrupted));
  CHECK(fs::exists(interrupted / "__0_0.distcp"));
  CHECK(fs::exists(interrupted / "__1_0.distcp"));
  CHECK(job::checkpoint_dict(interrupted).at("global_step").toInt() == 6);
  CHECK(job::checkpoint_dict(dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 4);

  const ProcessRun resumed = job::run_example(dir / "job.toml", dir.path());
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  FULGUR_CHECK_CONTAINS(resumed.output, "Restored training state from " + interrupted.string());
  CHECK(job::same_weights(dir / "ckpt" / "last.ckpt", ref / "ckpt" / "last.ckpt"));
}

TEST_CASE("elastic: torchrun --max-restarts restarts a killed group and every rank resumes from the last checkpoint") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"kill-at-step"});
  auto torchrun = [&](const fs::path& run_dir, const std::string& extra_args) {
    std::vector<std::string> args = {FULGUR_TEST_PYTHON, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2"};
    if (!extra_args.empty()) args.push_back(extra_args);
    for (const char* a : {"--no-python", FULGUR_TEST_FASHION_MNIST, "--config"}) args.emplace_back(a);
    args.push_back((run_dir / "job.toml").string());
    return fulgur::test::run_process(args, {{"FULGUR_LOG_LEVEL", "info"}}, run_dir);
  };
  const std::string ddp = "strategy = \"ddp\"\n";
  const fs::path ref = dir.subdir("reference");
  std::ofstream(ref / "job.toml") << job::toml(ref, plugins, 1, 16, ddp, job::checkpointing(ref / "ckpt", 4));
  const ProcessRun reference = torchrun(ref, "");
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);

  // SIGKILL at step 7 (last.ckpt holds step 4); torchrun restarts both workers once, and they
  // resume by themselves: no ckpt_path, TORCHELASTIC_RESTART_COUNT = 1 tells them.
  const fs::path run_dir = dir.subdir("elastic");
  std::ofstream(run_dir / "job.toml") << job::toml(
      run_dir, plugins, 1, 16, ddp,
      job::checkpointing(run_dir / "ckpt", 4) +
          "[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = 7\nmarker = \"" + (run_dir / "killed").string() +
          "\"\n");
  const ProcessRun restarted = torchrun(run_dir, "--max-restarts=1");
  INFO(restarted.output);
  REQUIRE(restarted.exit_code == 0);
  CHECK(fs::exists(run_dir / "killed"));
  FULGUR_CHECK_CONTAINS(restarted.output, "exitcode: -9");
  FULGUR_CHECK_CONTAINS(restarted.output, "TORCHELASTIC_RESTART_COUNT = 1: this job was restarted");
  FULGUR_CHECK_CONTAINS(restarted.output, "Restored training state from " + (run_dir / "ckpt" / "last.ckpt").string() +
                                              " (epoch 0, global step 4, 4 batches into the epoch)");
  CHECK(job::checkpoint_dict(run_dir / "ckpt" / "last.ckpt").at("global_step").toInt() == 16);
  CHECK(job::same_weights(run_dir / "ckpt" / "last.ckpt", ref / "ckpt" / "last.ckpt"));
}

// ---- on_exception_checkpoint ----------------------------------------------------------------------

TEST_CASE("on_exception_checkpoint: passes the testing kit and saves only for a failed fit on one process") {
  namespace kit = fulgur::testing;
  TempDir dir;
  CHECK_NOTHROW(kit::check_callback_conformance(
      kit::create_plugin<fulgur::Callback>(fulgur::PluginKind::callback, "on_exception_checkpoint")));
  auto callback =
      kit::create_plugin<fulgur::Callback>(fulgur::PluginKind::callback, "on_exception_checkpoint",
                                           {{"dirpath", (dir / "saved").string()}, {"filename", std::string("crash")}});
  fulgur::testing::FakeTrainer trainer(dir.path().string());
  const std::runtime_error failure("boom");
  callback->on_exception(trainer, failure);  // before fit started: nothing to save
  CHECK(trainer.saves.empty());
  callback->on_fit_start(trainer);
  callback->on_exception(trainer, failure);
  REQUIRE(trainer.saves.size() == 1);
  CHECK(trainer.saves[0].first == (dir / "saved" / "crash.ckpt").string());
  CHECK(trainer.saves[0].second == false);  // a full checkpoint

  // Several processes: the others are not waiting for a collective save; none is attempted.
  callback->on_fit_start(trainer);
  trainer.cluster_info.world_size = 2;
  callback->on_exception(trainer, failure);
  CHECK(trainer.saves.size() == 1);

  // Lightning's default name, in default_root_dir when dirpath is empty.
  auto defaults = kit::create_plugin<fulgur::Callback>(fulgur::PluginKind::callback, "on_exception_checkpoint");
  fulgur::testing::FakeTrainer single(dir.path().string());
  defaults->on_fit_start(single);
  defaults->on_exception(single, failure);
  REQUIRE(single.saves.size() == 1);
  CHECK(single.saves[0].first == (dir / "on_exception.ckpt").string());

  CHECK_THROWS_WITH_AS(kit::create_plugin<fulgur::Callback>(fulgur::PluginKind::callback, "on_exception_checkpoint",
                                                            {{"filename", std::string("a/b")}}),
                       doctest::Contains("must be a file name without '/'"), fulgur::Error);
}

TEST_CASE("on_exception_checkpoint: a fit that fails in a hook leaves a checkpoint of that moment") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"thrower"});
  std::ofstream(dir / "job.toml") << job::toml(
      dir.path(), plugins, 2, 20, "",
      "[[callbacks]]\nname = \"fixture_thrower\"\nstep = 7\n[[callbacks]]\nname = \"on_exception_checkpoint\"\n"
      "dirpath = \"" +
          (dir / "failed").string() + "\"\n");
  const ProcessRun run = job::run_example(dir / "job.toml", dir.path());
  INFO(run.output);
  CHECK(run.exit_code == 1);
  FULGUR_CHECK_CONTAINS(run.output, "the fixture gave up on purpose");
  const fs::path saved = dir / "failed" / "on_exception.ckpt";
  REQUIRE(fs::exists(saved));
  const auto checkpoint = job::checkpoint_dict(saved);
  CHECK(checkpoint.at("global_step").toInt() == 7);
  CHECK(checkpoint.contains("optimizer_states"));
}

// ---- a crash names its culprit ---------------------------------------------------------------------

TEST_CASE("crash report: a fatal signal in a plugin's hook or constructor names the plugin, file, hook and step") {
  TempDir dir;
  const fs::path plugins = job::plugin_dir(dir, {"hook-crash"});
  const std::string file = (plugins / "libfulgur-fixture-hook-crash.so").string();
  struct Case {
    std::string options;
    int signal;
    std::string expected;
  };
  const Case cases[] = {
      {"how = \"segv\"\nstep = 3\n", SIGSEGV,
       "fulgur: fatal signal 11 (SIGSEGV) in callback 'fixture_hook_crash' (" + file +
           "), hook on_train_batch_end, at epoch 0, global step 3"},
      {"how = \"abort\"\nstep = 24\n", SIGABRT,
       "fulgur: fatal signal 6 (SIGABRT) in callback 'fixture_hook_crash' (" + file +
           "), hook on_train_batch_end, at epoch 1, global step 24"},
      {"how = \"fpe\"\nstep = 2\n", SIGFPE,
       "fulgur: fatal signal 8 (SIGFPE) in callback 'fixture_hook_crash' (" + file +
           "), hook on_train_batch_end, at epoch 0, global step 2"},
      {"how = \"segv\"\nin_constructor = true\n", SIGSEGV,
       "fulgur: fatal signal 11 (SIGSEGV) in callback 'fixture_hook_crash' (" + file + "), while creating it"},
  };
  for (const Case& c : cases) {
    INFO(c.options);
    std::ofstream(dir / "job.toml") << job::toml(dir.path(), plugins, 2, 20, "",
                                                 "[[callbacks]]\nname = \"fixture_hook_crash\"\n" + c.options);
    const ProcessRun run =
        job::run_example(dir / "job.toml", dir.path(), {{"FULGUR_PLUGIN_CACHE", (dir / "cache").string()}});
    INFO(run.output);
    CHECK(run.exit_code == -c.signal);  // it still dies of that signal
    FULGUR_CHECK_CONTAINS(run.output, c.expected);
  }
}
