#include "signal_connector.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <ATen/ops/full.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <string_view>

#include "distributed/local_launcher.h"

extern char** environ;

namespace fulgur {

namespace {

namespace fs = std::filesystem;

// Set by the handler, read at safe points. A lock-free atomic int is async-signal-safe.
std::atomic<int> g_received{0};
bool g_handled = false;  // a safe point acted on it
static_assert(std::atomic<int>::is_always_lock_free);

// What the current fit set up (one fit at a time per process: signals are process-wide).
struct Setup {
  std::string checkpoint;  // absolute path of the interruption checkpoint
  int requeue_signal = 0;  // 0: no auto-requeue (not under SLURM, or disabled)
};
Setup g_setup;

struct NamedSignal {
  const char* name;
  int number;
};
constexpr NamedSignal kRequeueSignals[] = {{"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGHUP", SIGHUP},
                                           {"SIGCONT", SIGCONT}, {"SIGURG", SIGURG},   {"SIGXCPU", SIGXCPU}};

const char* signal_name(int sig) {
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGINT) return "SIGINT";
  for (const auto& s : kRequeueSignals)
    if (s.number == sig) return s.name;
  return "a signal";
}

// "" -> 0; "SIGUSR1" or "USR1" -> its number; anything else -> -1.
int parse_requeue_signal(std::string_view text) {
  if (text.empty()) return 0;
  for (const auto& s : kRequeueSignals)
    if (text == s.name || text == std::string_view(s.name).substr(3)) return s.number;
  return -1;
}

void write_all(const char* text) {
  size_t size = std::strlen(text);
  while (size > 0) {
    const ssize_t n = ::write(STDERR_FILENO, text, size);
    if (n <= 0 && errno != EINTR) return;
    if (n > 0) text += n, size -= static_cast<size_t>(n);
  }
}

// Async-signal-safe: an atomic store and write(2) of fixed text.
void on_signal(int sig) {
  const int saved_errno = errno;
  int expected = 0;
  if (g_received.compare_exchange_strong(expected, sig)) {
    if (sig == SIGTERM)
      write_all("fulgur: SIGTERM received: stopping after the current step, with a checkpoint\n");
    else if (sig == SIGINT)
      write_all("fulgur: SIGINT received: stopping after the current step, with a checkpoint (again to abort)\n");
    else
      write_all("fulgur: requeue signal received: checkpoint after the current step, then scontrol requeue\n");
  }
  errno = saved_errno;
}

void install(int sig, struct sigaction* previous) {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  // SIGINT twice is the usual "really stop": the second one takes the default action.
  action.sa_flags = SA_RESTART | (sig == SIGINT ? SA_RESETHAND : 0);
  ::sigaction(sig, &action, previous);
}

std::string slurm_job_id() {
  const char* array_job = std::getenv("SLURM_ARRAY_JOB_ID");
  const char* array_task = std::getenv("SLURM_ARRAY_TASK_ID");
  if (array_job && *array_job && array_task && *array_task) return fmt::format("{}_{}", array_job, array_task);
  const char* job = std::getenv("SLURM_JOB_ID");
  return job ? job : "";
}

// `scontrol requeue JOB`, found on PATH; its exit status (or -1 when it could not run).
int run_scontrol_requeue(const std::string& job) {
  std::string program = "scontrol", verb = "requeue", id = job;
  char* argv[] = {program.data(), verb.data(), id.data(), nullptr};
  pid_t pid = 0;
  if (::posix_spawnp(&pid, "scontrol", nullptr, nullptr, argv, environ) != 0) return -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string checkpoint_path(const Config& config, const std::string& root_dir) {
  const std::string& name = config.trainer.get_string("interrupt_checkpoint");
  if (name.empty()) return {};
  fs::path path(name);
  if (path.is_relative() && is_storage_url(root_dir))
    return join_storage_path(root_dir, path.lexically_normal().string());
  if (path.is_relative()) path = fs::path(root_dir) / path;
  return path.lexically_normal().string();
}

int restart_count(const char* variable) {
  const char* v = std::getenv(variable);
  return v ? std::atoi(v) : 0;
}

}  // namespace

void validate_signal_options(const Config& config) {
  auto where = [&](std::string_view key) {
    auto it = config.trainer_locations.find(key);
    return it == config.trainer_locations.end() ? std::string("[trainer]") : it->second.str() + ": [trainer]";
  };
  const std::string& requeue = config.trainer.get_string("requeue_signal");
  if (parse_requeue_signal(requeue) < 0)
    throw Error(ErrorKind::config,
                fmt::format("{} requeue_signal = \"{}\": use one of SIGUSR1, SIGUSR2, SIGHUP, SIGCONT, SIGURG, SIGXCPU "
                            "(what sbatch --signal sends), or \"\" to turn SLURM auto-requeue off",
                            where("requeue_signal"), requeue));
  const std::string& name = config.trainer.get_string("interrupt_checkpoint");
  const std::string base = fs::path(name).filename().string();
  if (!name.empty() && (base.empty() || base == "." || base == ".."))
    throw Error(ErrorKind::config,
                fmt::format("{} interrupt_checkpoint = \"{}\" names a directory; give a file name such as "
                            "\"interrupted.ckpt\", or \"\" to leave SIGTERM and SIGINT their default action",
                            where("interrupt_checkpoint"), name));
}

SignalScope::SignalScope(const Config& config, const std::string& root_dir)
    : uncaught_at_start_(std::uncaught_exceptions()) {
  g_received.store(0);
  g_handled = false;
  g_setup = Setup{};
  g_setup.checkpoint = checkpoint_path(config, root_dir);
  if (g_setup.checkpoint.empty()) return;  // turned off: signals keep their default action
  active_ = true;
  install(SIGTERM, &previous_term_);
  install(SIGINT, &previous_int_);
  // Lightning's SLURMEnvironment(auto_requeue=True): only inside a SLURM job.
  if (!slurm_job_id().empty()) {
    requeue_signal_ = parse_requeue_signal(config.trainer.get_string("requeue_signal"));
    if (requeue_signal_ > 0) {
      g_setup.requeue_signal = requeue_signal_;
      install(requeue_signal_, &previous_requeue_);
    }
  }
}

SignalScope::~SignalScope() {
  if (!active_) return;
  ::sigaction(SIGTERM, &previous_term_, nullptr);
  ::sigaction(SIGINT, &previous_int_, nullptr);
  if (requeue_signal_ > 0) ::sigaction(requeue_signal_, &previous_requeue_, nullptr);
  // Fit ended normally after the signal but before a safe point saw it: not lost, but passed on.
  const int pending = g_received.load();
  if (pending != 0 && !g_handled && std::uncaught_exceptions() == uncaught_at_start_) ::raise(pending);
}

int signals::received() { return g_received.load(std::memory_order_relaxed); }

namespace {

// FULGUR_SIGNAL_VOTE_EVERY=N (default 1): vote after every N-th batch only, so a stop comes up to 2N
// batches after the signal; 0: no vote mid-epoch, a measurement switch for bench/distributed.sh (a
// signal then reaches only the signalled rank: not for real runs). Every rank reads the same
// environment (launchers pass it on) and counts the same batches, so all vote at the same ones.
int64_t vote_every() {
  static const int64_t every = [] {
    const char* text = std::getenv("FULGUR_SIGNAL_VOTE_EVERY");
    if (text == nullptr || *text == '\0') return int64_t{1};
    char* end = nullptr;
    const long long n = std::strtoll(text, &end, 10);
    if (*end != '\0' || n < 0)
      throw Error(ErrorKind::config, fmt::format("FULGUR_SIGNAL_VOTE_EVERY = '{}': expected a whole number >= 0 "
                                                 "(batches between signal votes; 0 = none, for measurements)",
                                                 text));
    return static_cast<int64_t>(n);
  }();
  return every;
}

// Batches this process has ended with several ranks (SignalVote::after_batch calls).
int64_t g_vote_batches = 0;

}  // namespace

bool SignalVote::after_batch() {
  const int64_t every = vote_every();
  if (every == 0 || ++g_vote_batches % every != 0) return false;
  if (finish()) return true;
  ballot_ = at::full({1}, static_cast<int64_t>(signals::received()), at::TensorOptions().dtype(at::kLong));
  pending_ = communicator_->all_reduce_async(ballot_, ReduceOp::max);
  return false;
}

bool SignalVote::finish() {
  if (!pending_) return false;
  pending_->wait();
  pending_.reset();
  return ballot_.item<int64_t>() != 0;
}

void interrupt_at_safe_point(TrainerContext& trainer) {
  const bool several = trainer.cluster().world_size > 1;
  int sig = signals::received();
  if (several) {
    // Ranks may have received different signals (or none, when only one was signalled): the
    // highest number decides, the same on every rank. A requeue wins over a plain stop.
    const at::Tensor mine = at::full({2}, 0, at::TensorOptions().dtype(at::kLong).device(trainer.device()));
    mine[0].fill_(sig);
    mine[1].fill_(sig != 0 && sig == g_setup.requeue_signal ? 1 : 0);
    const at::Tensor all = trainer.reduce(mine, ReduceOp::max).cpu();
    sig = static_cast<int>(all[0].item<int64_t>());
    if (all[1].item<int64_t>() != 0) sig = g_setup.requeue_signal;
    // Our launcher's children exit with the same status: that is no failure to report.
    detail::note_local_run_interrupted(128 + sig);
  }
  if (sig == 0) sig = SIGTERM;
  g_handled = true;
  const bool requeue = sig == g_setup.requeue_signal;
  spdlog::warn("{} received: saving {} at epoch {}, global step {}", signal_name(sig), g_setup.checkpoint,
               trainer.current_epoch(), trainer.global_step());
  trainer.save_checkpoint(g_setup.checkpoint, /*weights_only=*/false);
  if (requeue && trainer.is_global_zero()) {
    const std::string job = slurm_job_id();
    const int status = run_scontrol_requeue(job);
    if (status == 0)
      spdlog::warn("requeued SLURM job {} (scontrol requeue {}); it resumes from {}", job, job, g_setup.checkpoint);
    else
      spdlog::error("scontrol requeue {} failed ({}); the checkpoint {} is written, requeue the job by hand", job,
                    status < 0 ? std::string("could not run scontrol") : fmt::format("exit status {}", status),
                    g_setup.checkpoint);
  }
  throw TrainingInterrupted{sig, g_setup.checkpoint};
}

void exit_interrupted(const TrainingInterrupted& stop) {
  const int code = 128 + stop.signal;
  spdlog::warn("training interrupted by {}; resume with ckpt_path = \"last\" (or \"{}\"); exiting with status {}",
               signal_name(stop.signal), stop.checkpoint, code);
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  // std::exit, not _exit: Fulgur's launcher waits for its other ranks at exit.
  std::exit(code);
}

std::string restart_ckpt_path(const std::string& requested) {
  if (!requested.empty()) return requested;
  for (const char* variable : {"SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    if (const int count = restart_count(variable); count > 0) {
      spdlog::info("{} = {}: this job was restarted, so fit resumes from the last checkpoint (ckpt_path = \"last\")",
                   variable, count);
      return "last";
    }
  }
  return requested;
}

std::string existing_interrupt_checkpoint(const Config& config, const std::string& root_dir) {
  const std::string path = checkpoint_path(config, root_dir);
  return checkpoint_completed_ns(path) ? path : std::string();
}

std::string newer_checkpoint(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return a.empty() ? b : a;
  const std::optional<int64_t> ta = checkpoint_completed_ns(a), tb = checkpoint_completed_ns(b);
  if (!ta) return b;
  if (!tb) return a;
  return *tb > *ta ? b : a;
}

}  // namespace fulgur
