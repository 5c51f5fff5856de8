// Internal: signals that end a fit cleanly (Lightning's SignalConnector, SLURM auto-requeue).
//
// SIGTERM and SIGINT (and, under SLURM, the requeue signal, SIGUSR1 by default) only set a flag.
// At the next safe point of the training loop (after a training batch and whatever validation
// follows it, or after an epoch's end) every rank agrees whether any of them received one; if so,
// every rank takes part in writing one consistent checkpoint (`interrupt_checkpoint`, relative to
// default_root_dir), rank zero runs `scontrol requeue` for the requeue signal, the loggers are
// finalized as "interrupted" and the process exits with 128 + the signal's number (143 for SIGTERM).
//
// `ckpt_path = "last"` picks the newer of that checkpoint and the checkpoint callbacks' last one,
// and a fit that a scheduler restarted (SLURM_RESTART_COUNT or TORCHELASTIC_RESTART_COUNT > 0)
// with no ckpt_path resumes as if it said "last".
#pragma once

#include <fulgur/communicator.h>
#include <fulgur/config.h>
#include <fulgur/trainer_context.h>

#include <ATen/core/Tensor.h>

#include <csignal>
#include <memory>
#include <string>

namespace fulgur {

// Thrown out of the training loop once the interruption checkpoint is written. Deliberately not a
// std::exception: nothing between the loop and the stage funnel may mistake it for a failure.
struct TrainingInterrupted {
  int signal = 0;
  std::string checkpoint;  // what was written
};

// Checks [trainer] interrupt_checkpoint and requeue_signal (config check and the Trainer).
void validate_signal_options(const Config& config);

// Installs the handlers for the life of a fit and restores the previous ones afterwards. A signal
// that came too late for a safe point (fit's last hooks) is raised again then, so it takes the
// previous action instead of being lost.
class SignalScope {
 public:
  SignalScope(const Config& config, const std::string& root_dir);
  ~SignalScope();
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  bool active_ = false;
  int requeue_signal_ = 0;
  int uncaught_at_start_ = 0;
  struct sigaction previous_term_ {
  }, previous_int_{}, previous_requeue_{};
};

namespace signals {

// The signal this process received during the current fit (0: none). One relaxed load: this is
// what the hot loop pays on a single process.
int received();

}  // namespace signals

// At a safe point: true when this rank or any other received a stopping signal. With several
// processes this is one boolean all-reduce per call (every rank calls it at the same points).
inline bool interrupt_due(TrainerContext& trainer) {
  const int local = signals::received();
  if (trainer.cluster().world_size <= 1) return local != 0;
  return trainer.agree(local != 0, /*all=*/false);
}

// The per-batch agreement one batch behind, for several processes on Gloo: after batch i every
// rank starts an asynchronous max-all-reduce of the signal it received and waits for the one it
// started after batch i - 1, which had a whole step to finish; all ranks act on that result at the
// same batch. A stop comes one batch later than with interrupt_due(), whose blocking all-reduce
// after every batch cost 14% of a small MLP's ddp step (bench/ddp.sh). Not for NCCL: reading the
// result there would synchronise the device every batch; interrupt_due() stays for it.
class SignalVote {
 public:
  explicit SignalVote(std::shared_ptr<Communicator> communicator) : communicator_(std::move(communicator)) {}
  // After a training batch: true when the vote in flight says a rank received a signal (then no
  // new vote starts: every rank goes to interrupt_at_safe_point). Otherwise starts the next vote.
  bool after_batch();
  // Where the batches end (the epoch's end, or a limit): the result of the vote in flight, if any.
  bool finish();

 private:
  std::shared_ptr<Communicator> communicator_;
  at::Tensor ballot_;
  std::unique_ptr<PendingCollective> pending_;
};

// Writes the interruption checkpoint (every rank takes part), requeues a SLURM job if that was
// asked, and throws TrainingInterrupted. Call it on every rank when interrupt_due() said so.
[[noreturn]] void interrupt_at_safe_point(TrainerContext& trainer);

// After the loggers were finalized: flushes what was printed and exits with 128 + the signal.
[[noreturn]] void exit_interrupted(const TrainingInterrupted& stop);

// ckpt_path for fit: `requested` unless it is empty and a scheduler restarted this job, then "last".
std::string restart_ckpt_path(const std::string& requested);

// The interruption checkpoint of a run rooted at `root_dir` ("" when none exists).
std::string existing_interrupt_checkpoint(const Config& config, const std::string& root_dir);

// Of two checkpoint paths (either may be empty), the one modified last (Lightning's rule for "last").
std::string newer_checkpoint(const std::string& a, const std::string& b);

}  // namespace fulgur
