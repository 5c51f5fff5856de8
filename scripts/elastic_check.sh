#!/usr/bin/env bash
# torchrun elastic for real (issue #39 item 3): three torchrun agents on this machine, each its own
# node (--nnodes=2:3, c10d rendezvous), train tests/ddp_worker.cpp's MLP under ddp. Once a
# checkpoint exists, one agent and its worker are SIGKILLed: the two others re-rendezvous at 2 and
# their workers resume from the last checkpoint by themselves. A fourth agent is then started: the
# two agents see a node waiting, SIGTERM their workers (Fulgur writes interrupted.ckpt at the next
# batch boundary), and the group re-forms at 3 and resumes from it. Checks at the end: the job ends
# well, Fulgur's "resumed at step S of epoch E with M processes (was N)" lines for both changes, and
# each epoch's samples, taken from the last process group that trained each step, are every row
# once, plus exactly the padding DistributedSampler's rule adds where a resume dealt an uneven rest.
#
#   scripts/elastic_check.sh [build-dir] [out-dir]      (about a minute on 2 busy cores)
#
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is needed with torch 2.11: with the shared store (its
# default) a node joining a running group waits forever for MASTER_ADDR in torch's rendezvous
# (DynamicRendezvousHandler caches the first round's store address, so nobody writes the key for
# the new round), and the agents already in the group time out in _assign_worker_ranks on
# torchelastic/assigned_ranks. ELASTIC_CHECK_SHARED_STORE=1 runs with the shared store to see it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:-$here/build}" && pwd)"
out="${2:-$(mktemp -d /tmp/fulgur-elastic.XXXXXX)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="$(sed -n 's/^FULGUR_PYTHON:[A-Z]*=//p' "$build/CMakeCache.txt")"
[ -x "$python" ] || python="$HOME/.cache/fulgur/venv/bin/python"
worker="$(find "$build" -name fulgur_ddp_worker -type f -perm -u+x | head -1)"
[ -x "$worker" ] || { echo "no fulgur_ddp_worker under $build: build the tests first" >&2; exit 2; }
port="$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

cat >"$out/run.toml" <<EOF
[trainer]
accelerator = "cpu"
strategy = "ddp"
devices = "auto"
num_nodes = 0
max_epochs = 3
seed = 7
num_sanity_val_steps = 0
limit_val_batches = 2
enable_progress_bar = false
enable_model_summary = false
logger = false
default_root_dir = "$out"

[strategy]
timeout = 20.0

[data]
batch_size = 4
shuffle = true

[[callbacks]]
name = "model_checkpoint"
dirpath = "$out/ckpts"
filename = "{step}"
every_n_train_steps = 2
save_top_k = -1
save_last = true
EOF

share=1
[ "${ELASTIC_CHECK_SHARED_STORE:-0}" = 1 ] && share=0
agents=()
start_agent() {  # name
  (cd "$out" && exec env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$share FULGUR_TEST_RECORD_SAMPLES=round \
    FULGUR_TEST_STEP_SLEEP_MS="${ELASTIC_CHECK_STEP_MS:-250}" FULGUR_LOG_LEVEL=info LOGLEVEL=INFO \
    "$python" -m torch.distributed.run --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d \
    --rdzv-endpoint="127.0.0.1:$port" --rdzv-id=fulgur-elastic --max-restarts=3 --monitor-interval=1 \
    --rdzv-conf=join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3 \
    --no-python "$worker" "$out/run.toml" "$out") >"$out/agent_$1.log" 2>&1 &
  agents+=("$!")
  echo "agent $1: pid $!"
}
cleanup() { for p in "${agents[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_for() {  # file, seconds
  for _ in $(seq $((${2} * 5))); do [ -e "$1" ] && return 0; sleep 0.2; done
  echo "timed out waiting for $1" >&2
  exit 1
}

# The first agent hosts the rendezvous store (--rdzv-endpoint on this machine): it stays.
start_agent a
sleep 1
start_agent b
start_agent c
wait_for "$out/ckpts/step=4.ckpt" 120
# Agent c and its worker die (a lost node): SIGKILL the agent first, so that it restarts nothing.
victim="$(pgrep -P "${agents[2]}" | head -1)"
rank="$(tr '\0' '\n' <"/proc/$victim/environ" | grep '^RANK=' || true)"
kill -9 "${agents[2]}"
kill -9 "$victim"
echo "killed agent c (pid ${agents[2]}) and its worker (pid $victim, $rank)"
wait_for "$out/ckpts/step=14.ckpt" 180
start_agent d
status=0
for i in 0 1 3; do wait "${agents[$i]}" || status=$?; done
trap - EXIT
echo "agents done (status $status); logs in $out"
grep -h -E "Rendezvous complete|group_world_size=|Detected .* new nodes|will restart worker group|exitcode" \
  "$out"/agent_*.log | sed 's/^/  agent: /' | sort | uniq -c | sort -rn | head -20
grep -h -E "resumed at step|Restored training state|this job was restarted|training interrupted by" "$out"/agent_*.log |
  sed 's/^.*\] //' | sort | uniq -c | sed 's/^/  fulgur: /'
[ "$status" = 0 ] || { echo "FAILED: an agent ended with status $status" >&2; exit 1; }

# Every epoch: the samples of the last process group that trained each step.
"$python" - "$out" <<'EOF'
import collections, glob, math, os, re, sys
out = sys.argv[1]
rounds = collections.defaultdict(list)  # port -> files
for f in glob.glob(f"{out}/samples_rank*_port*.txt"):
    rounds[re.search(r"_port(\d+)", f).group(1)].append(f)
order = sorted(rounds, key=lambda p: max(os.path.getmtime(f) for f in rounds[p]))
owner, records = {}, collections.defaultdict(list)  # (epoch, step) -> round
for port in order:
    for f in rounds[port]:
        for line in open(f):
            e, s, i = map(int, line.split())
            owner[(e, s)] = port
            records[(port, e, s)].append(i)
seen = collections.defaultdict(collections.Counter)
for (e, s), port in owner.items():
    seen[e].update(records[(port, e, s)])
logs = "".join(open(f).read() for f in glob.glob(f"{out}/agent_*.log"))
pad = collections.Counter()
for m in re.finditer(r"resumed at step \d+ of epoch (\d+) with (\d+) processes \(was \d+\); (\d+) samples", logs):
    e, r, k = map(int, m.groups())
    pad[e] = math.ceil(k / r) * r - k
ok = len(order) >= 3 and sorted(seen) == [0, 1, 2]
for e in sorted(seen):
    c = seen[e]
    once = set(c) == set(range(96))
    extra = sum(c.values()) - 96
    print(f"  epoch {e}: {len(c)} distinct rows of 96, {extra} repeated (padding expected {pad[e]})")
    ok &= once and extra == pad[e]
print(f"  {len(order)} process groups (ports {', '.join(order)})")
print("OK: every sample of every epoch once (plus the sampler's padding)" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF
