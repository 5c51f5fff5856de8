#!/usr/bin/env bash
# A real SLURM on this machine (issue #17 item 7): installs Debian's slurm packages if missing,
# starts munged, slurmctld and slurmd on localhost from a generated slurm.conf (in a temporary
# directory, with their logs), then drives the shipped fashion_mnist program through them:
#   srun     `srun -n 2` trains with strategy ddp: exit 0, both ranks in the run (the checkpoint
#            records world size 2), a checkpoint on disk, one metrics.csv (rank 0) with no row twice
#   requeue  an `sbatch --requeue -n 2` job gets USR1 mid-run (sent with `scancel --signal=USR1`,
#            what `sbatch --signal=USR1@N` does at N seconds before the time limit): it writes the
#            interruption checkpoint, runs `scontrol requeue`, SLURM starts it again with
#            SLURM_RESTART_COUNT=1, it resumes from that checkpoint and finishes with weights
#            bitwise equal to the uninterrupted srun run (same TOML)
# Prints PASS/FAIL per scenario and exits 1 on a failure. When the daemons cannot start here, or
# cannot launch a plain two-task step, it prints why (their log lines) and "SKIPPED: ..." and
# exits 0. CI does not run this (it installs packages and starts daemons); tests/signal_test.cpp
# covers the same logic with a fake scontrol on PATH.
#
# usage: scripts/slurm_check.sh [--keep] [--steps N]
#   --keep     keep the temporary directory (configs, daemon logs, job output, checkpoints)
#   --steps N  training batches per rank and epoch (2 epochs; default 100, at least 20)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."

keep=0
steps=100
while (($#)); do
  case "$1" in
    --keep) keep=1; shift ;;
    --steps) steps=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0" | cut -c3-; exit 0 ;;
    *) echo "slurm_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ $steps =~ ^[0-9]+$ ]] || ((steps < 20)); then
  echo "slurm_check.sh: --steps $steps: must be an integer of at least 20 (the requeue signal goes in after the checkpoint at step 20, mid-run)" >&2
  exit 2
fi

if [ "$(id -u)" -ne 0 ]; then
  # slurmd starts job steps as their user and this slurm.conf runs the daemons as root.
  echo "SKIPPED: slurm_check.sh needs root (to install packages and run slurmctld, slurmd and munged); run it with sudo"
  exit 0
fi

# ---- packages (only the missing ones) and the program under test ---------------------------------
missing=()
for p in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "slurm_check.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
"$here/build.sh" --target fashion_mnist fulgur_strategy_ddp fulgur_logger_csv fulgur_callback_model_checkpoint >/dev/null
program="$(pwd)/$FULGUR_BUILD_DIR/bin/fashion_mnist"
python="$FULGUR_VENV/bin/python"

work="$(mktemp -d /tmp/fulgur-slurm.XXXXXX)"
node="$(hostname -s)"
pids=()          # daemons this script started (slurmd first: it is stopped before slurmctld)
jobs_started=()  # SLURM jobs this script submitted
munged_started=0
failed=0

cleanup() {
  local status=$?
  set +e
  for job in "${jobs_started[@]}"; do scancel "$job" 2>/dev/null; done
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
  done
  if ((munged_started)) && [ -f /run/munge/munged.pid ]; then kill -TERM "$(cat /run/munge/munged.pid)" 2>/dev/null; fi
  if ((keep || failed || status)); then echo "slurm_check.sh: kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

skip() {
  echo "SKIPPED: $1"
  keep=1  # the logs named below stay for a closer look
  shift
  for log in "$@"; do
    [ -s "$log" ] && { echo "--- last lines of $log:"; tail -n 15 "$log"; }
  done
  exit 0
}

# ---- munge: a key if there is none, munged if none answers -----------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge
  # munged refuses to run as root with a key root owns: it runs as the munge user, as its unit does.
  runuser -u munge -- /usr/sbin/munged >"$work/munged.out" 2>&1 || true
  munged_started=1
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 ||
    skip "munged does not start or answer (munge -n | unmunge fails)" "$work/munged.out" /var/log/munge/munged.log
fi

# ---- slurm.conf for this machine alone ------------------------------------------------------------
free_port() {  # the first port from $1 up that nothing listens on
  local port=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
  echo "$port"
}
ctld_port=$(free_port 6817)
slurmd_port=$(free_port $((ctld_port + 1)))
mkdir -p "$work/state" "$work/spool"
export SLURM_CONF="$work/slurm.conf"
cat >"$SLURM_CONF" <<EOF
# Generated by scripts/slurm_check.sh: one node, this machine, no cgroups and no accounting.
ClusterName=fulgur
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits for its old step credentials to expire before it starts again: 120 s by
# default (measured: the restart came 154 s after the requeue with the defaults). Steps here
# launch within a second, so 20 s of credential lifetime is plenty.
AuthInfo=cred_expire=20
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# A container has no cgroup hierarchy of its own to give slurm: track processes by parent id.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# The requeued job is picked up within seconds of becoming eligible, not at the next 60 s pass.
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -D -f "$SLURM_CONF" >"$work/slurmctld.out" 2>&1 &
ctld_pid=$!
slurmd -D -f "$SLURM_CONF" -N "$node" >"$work/slurmd.out" 2>&1 &
pids=("$!" "$ctld_pid")
state=""
for _ in $(seq 150); do
  state="$(sinfo -h -N -n "$node" -o %T 2>/dev/null || true)"
  [ "$state" = "idle" ] && break
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || skip "a slurm daemon (pid $pid) exited at start" \
      "$work/slurmctld.out" "$work/slurmctld.log" "$work/slurmd.out" "$work/slurmd.log"
  done
  sleep 0.2
done
[ "$state" = "idle" ] || skip "node $node is '${state:-not reported}' after 30 s, not idle" \
  "$work/slurmctld.out" "$work/slurmctld.log" "$work/slurmd.out" "$work/slurmd.log"
# A job step that cannot start here (a plugin slurmd cannot initialise in this container, say) is
# the machine's limit, not Fulgur's: two tasks that only print their rank tell them apart. srun
# can exit 0 when no task launched, so the output counts.
timeout 120 srun -n 2 -N 1 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS"' >"$work/preflight.txt" 2>&1 || true
[ "$(grep -c '^task [01] of 2$' "$work/preflight.txt")" -eq 2 ] ||
  skip "slurm cannot launch a job step on this machine (srun -n 2 of a shell command)" \
    "$work/preflight.txt" "$work/slurmd.log"
echo "slurm_check.sh: slurmctld (port $ctld_port) and slurmd (port $slurmd_port) up, node $node runs jobs ($work)"

# ---- the training job, the same for both scenarios but for its directory ------------------------
# Set explicitly, it applies to every rank (by default ranks above 0 log warnings only), so each
# rank's "saving" and "Restored" lines show in the output, labelled by srun.
export FULGUR_LOG_LEVEL=info
write_toml() {  # $1: the scenario's directory
  cat >"$1/job.toml" <<EOF
[trainer]
accelerator = "cpu"
strategy = "ddp"
devices = "auto"            # one per process srun started
max_epochs = 2
limit_train_batches = $steps
limit_val_batches = 5
limit_test_batches = 2
num_sanity_val_steps = 0
seed = 7
log_every_n_steps = 10
enable_progress_bar = false
default_root_dir = "$1/runs"
[accelerator]
threads = 1                 # one core per rank
[model]
arch = "cnn"
[data]
batch_size = 32
num_workers = 0
[[loggers]]
name = "csv"
[[callbacks]]
name = "model_checkpoint"
dirpath = "$1/ckpt"
every_n_train_steps = 20
save_top_k = 0
save_last = true
EOF
}

ckpt_field() {  # $1: checkpoint, $2: top-level key
  "$python" -c 'import sys, torch; print(torch.load(sys.argv[1], weights_only=True)[sys.argv[2]])' "$1" "$2"
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

summary=()
check() {  # $1: scenario, $2: description, then the command that must succeed
  local scenario=$1 what=$2
  shift 2
  if "$@"; then
    echo "  ok: $what"
  else
    echo "  FAILED: $what"
    eval "${scenario}_ok=0"
  fi
}
contains() { grep -qF -- "$2" "$1"; }
contains_line() { grep -q -- "$2" "$1"; }

# ---- scenario srun: srun -n 2, ddp --------------------------------------------------------------
a="$work/srun"
mkdir -p "$a"
write_toml "$a"
echo "== srun: srun -n 2 $program --config $a/job.toml"
srun_ok=1
t0=$(now)
status=0
timeout 600 srun -n 2 -N 1 --label --kill-on-bad-exit=1 -J fulgur-srun-ddp "$program" --config "$a/job.toml" \
  >"$a/output.txt" 2>&1 || status=$?
srun_seconds=$(elapsed "$t0")
check srun "srun exit status 0 (got $status)" test "$status" -eq 0
check srun "last checkpoint on disk" test -s "$a/ckpt/last.ckpt"
if [ -s "$a/ckpt/last.ckpt" ]; then
  srun_world=$(ckpt_field "$a/ckpt/last.ckpt" world_size || echo "?")
  srun_steps=$(ckpt_field "$a/ckpt/last.ckpt" global_step || echo "?")
  check srun "both ranks took part: the checkpoint records world size 2 (got $srun_world)" test "$srun_world" = 2
  check srun "global step $((2 * steps)) (got $srun_steps)" test "$srun_steps" = $((2 * steps))
fi
csvs=$(find "$a/runs" -name metrics.csv 2>/dev/null | wc -l)
check srun "one metrics.csv (got $csvs)" test "$csvs" -eq 1
if [ "$csvs" -eq 1 ]; then
  # Two ranks writing would duplicate the (epoch, step) rows of the training loss.
  dup=$("$python" -c 'import csv, sys
rows = [(r["epoch"], r["step"]) for r in csv.DictReader(open(sys.argv[1])) if r.get("train/loss")]
print(len(rows) - len(set(rows)) if rows else -1)' "$(find "$a/runs" -name metrics.csv)")
  check srun "metrics written by one rank: no training row twice (duplicates: $dup)" test "$dup" -eq 0
fi
((srun_ok)) || { failed=1; tail -n 20 "$a/output.txt"; }
summary+=("srun     $( ((srun_ok)) && echo PASS || echo FAIL)  ${srun_seconds} s  srun -n 2 ddp, global step ${srun_steps:-?}, world size ${srun_world:-?}")

# ---- scenario requeue: sbatch --requeue, USR1 mid-run, resumed by SLURM ----------------------------
b="$work/requeue"
mkdir -p "$b"
write_toml "$b"
cat >"$b/job.sh" <<EOF
#!/bin/bash
echo "slurm_check: job \$SLURM_JOB_ID starts with SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-0}"
srun --label --kill-on-bad-exit=1 "$program" --config "$b/job.toml"
status=\$?
echo "slurm_check: srun exit status \$status"
exit \$status
EOF
echo "== requeue: sbatch --requeue -n 2 $b/job.sh"
requeue_ok=1
t0=$(now)
job=$(sbatch --parsable --requeue -n 2 -N 1 -J fulgur-requeue --open-mode=append -o "$b/job.out" -D "$b" "$b/job.sh")
jobs_started+=("$job")
job_field() { scontrol -o show job "$job" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p"; }
# The signal goes in once the run has written its first periodic checkpoint (step 20 of
# $((2 * steps))): mid-run, with most of the run still ahead.
signalled=0
for _ in $(seq 1200); do
  if [ -s "$b/ckpt/last.ckpt" ]; then
    scancel --signal=USR1 "$job" && signalled=1
    break
  fi
  case "$(job_field JobState)" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
  sleep 0.1
done
signal_at=$(elapsed "$t0")
check requeue "USR1 sent to the job's tasks after its first checkpoint ($signal_at s after sbatch)" test "$signalled" -eq 1
final_state=""
for _ in $(seq 1200); do
  final_state=$(job_field JobState)
  restarts=$(job_field Restarts)
  # Before the restart the first run ends too (requeue or not): only a signalled job waits for it.
  if [ "${restarts:-0}" -ge 1 ] || ((!signalled)); then
    case "$final_state" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
  fi
  sleep 0.5
done
requeue_seconds=$(elapsed "$t0")
check requeue "job COMPLETED after a restart (state $final_state, Restarts=$(job_field Restarts), ExitCode=$(job_field ExitCode))" \
  test "$final_state" = COMPLETED
for rank in 0 1; do
  check requeue "rank $rank got the signal" contains_line "$b/job.out" "^$rank: fulgur: requeue signal received"
  check requeue "rank $rank wrote its part of the checkpoint" \
    contains_line "$b/job.out" "^$rank: .*SIGUSR1 received: saving $b/runs/interrupted.ckpt"
done
check requeue "rank 0 ran scontrol requeue $job" contains "$b/job.out" "requeued SLURM job $job (scontrol requeue $job)"
check requeue "interruption checkpoint written" test -s "$b/runs/interrupted.ckpt"
check requeue "SLURM started the job again with SLURM_RESTART_COUNT=1" \
  contains "$b/job.out" "slurm_check: job $job starts with SLURM_RESTART_COUNT=1"
check requeue "the restarted job resumed by itself" \
  contains "$b/job.out" "SLURM_RESTART_COUNT = 1: this job was restarted"
for rank in 0 1; do
  check requeue "rank $rank restored the interruption checkpoint" \
    contains_line "$b/job.out" "^$rank: .*Restored training state from $b/runs/interrupted.ckpt"
done
check requeue "the restarted job finished (srun exit status 0)" contains "$b/job.out" "slurm_check: srun exit status 0"
if [ -s "$b/runs/interrupted.ckpt" ] && [ -s "$b/ckpt/last.ckpt" ]; then
  before=$(ckpt_field "$b/runs/interrupted.ckpt" global_step || echo "?")
  after=$(ckpt_field "$b/ckpt/last.ckpt" global_step || echo "?")
  check requeue "interrupted mid-run (global step $before of $((2 * steps)))" test "$before" -gt 0 -a "$before" -lt $((2 * steps))
  check requeue "global step continued to $((2 * steps)) (got $after)" test "$after" -eq $((2 * steps))
  if [ -s "$a/ckpt/last.ckpt" ]; then
    same=$("$python" -c 'import sys, torch
a = torch.load(sys.argv[1], weights_only=True)["state_dict"]
b = torch.load(sys.argv[2], weights_only=True)["state_dict"]
print("yes" if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else "no")' \
      "$a/ckpt/last.ckpt" "$b/ckpt/last.ckpt")
    check requeue "final weights bitwise equal to the uninterrupted srun run" test "$same" = yes
  fi
fi
# How long SLURM held the requeued job: from slurmctld's "Requeuing" line to the next start of
# the job (by the main scheduler or by backfill), its own timestamps.
held=$(awk -v job="JobId=$job" '
  function t(line) { gsub(/[][]/, "", line); split(line, p, /[-T:]/); return mktime(p[1] " " p[2] " " p[3] " " p[4] " " p[5] " 0") + p[6] }
  index($0, "Requeuing " job) && !a { a = t($1) }
  a && !b && ($0 ~ ("(Allocate|Started) " job " ")) { b = t($1) }
  END { if (a && b) printf "%.1f", b - a; else print "?" }' "$work/slurmctld.log")
((requeue_ok)) || { failed=1; tail -n 30 "$b/job.out"; }
summary+=("requeue  $( ((requeue_ok)) && echo PASS || echo FAIL)  ${requeue_seconds} s  USR1 at ${signal_at} s, global step ${before:-?} before the requeue, restarted ${held} s after it, ${after:-?} at the end, weights equal: ${same:-?}")

echo
echo "slurm_check.sh summary (slurm $(sinfo -V | awk '{print $2}'), node $node, $(nproc) CPUs):"
printf '  %s\n' "${summary[@]}"
exit "$failed"
