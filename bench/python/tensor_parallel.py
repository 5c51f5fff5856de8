"""Tensor parallelism's memory and communication per rank, measured from `fulgur fit`, next to the formulas.

The GPT example (examples/gpt) under `model_parallel` at tp = 1 (one process), tp = 2 and
dp x tp = 2 x 2, each with and without sequence parallelism ([model] sequence_parallel), on Gloo.
bench_step_probe (bench/step_probe.cpp) prints per rank, at the second step, the bytes of this
rank's parameters, gradients and AdamW state and the heap bytes forward left alive for backward
(activations), and after every step the bytes the process has written (/proc/self/io wchar: on
Gloo, what it sent on its sockets). Bytes sent per step is the median step-to-step difference
after the first steps.

Formulas (float32, C = n_embd, L = n_layer, V = 256, P = block_size positions, E = B*T*C elements
of one activation between blocks, B the rows per replica, t = tp, d = dp):
  parameters = 4 * ((V + P) C + 2C + L (6C + (12 C^2 + 7C) / t))   (qkv, proj, fc, proj split by t;
               LayerNorms and the row-parallel biases whole); gradients the same; AdamW state 2x.
  activations saved per block: without SP 4E + 13E/t (LayerNorm inputs and outputs whole; q, k, v,
               attention output, fc and gelu outputs split); with SP 2E + 15E/t (LayerNorm inputs
               split; the gathered inputs of the column-parallel layers are kept whole); then the head,
               replicated: 2E + B*T*V (ln_f's input and output, log_softmax's output); times 4 bytes.
  sent per step per rank on the tp group: without SP 2 all-reduces per block forward and 2 in
               backward, each 2 (t-1)/t * 4E bytes with a ring; with SP an all-gather and a
               reduce-scatter per attention and MLP, forward and backward, each (t-1)/t * 4E, plus
               the sequence's all-gather into the head and the embedding gradient's all-gather;
               plus on the dp group the gradients' all-reduce, 2 (d-1)/d * parameter bytes; with
               zero_stage 1 that all-reduce and the updated rows' all-gather, 3 (d-1)/d; with
               zero_stage 2 and 3 a reduce-scatter and the all-gather, 2 (d-1)/d (stage 3's
               per-block gathers again in backward add (d-1)/d of the blocks' bytes).
  zero_stage = s over dp ([strategy] zero_stage): AdamW state / d and gradients / d (s >= 1; measured
               after the step's reduction, which keeps this rank's rows only: stage 1 holds the whole
               gradient until then); s = 3: parameters / d, plus the parameters outside the
               blocks (embeddings, ln_f), which stay whole between steps.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

STEP_RE = re.compile(r"^FULGUR_STEP rank=(\d+) step=(\d+) .*wchar=(-?\d+)")
MEM_RE = re.compile(r"^FULGUR_MEMORY rank=(\d+) parameters=(\d+) gradients=(\d+) optimizer=(\d+) activations=(-?\d+)")

CASES = [  # name, dp, tp, sequence_parallel, zero_stage over dp
    ("tp=1 (one process)", 1, 1, False, 0),
    ("tp=2", 1, 2, False, 0),
    ("tp=2, SP", 1, 2, True, 0),
    ("dp x tp = 2 x 2", 2, 2, False, 0),
    ("dp x tp = 2 x 2, SP", 2, 2, True, 0),
    ("dp x tp = 2 x 2, zero_stage 1", 2, 2, False, 1),
    ("dp x tp = 2 x 2, zero_stage 2", 2, 2, False, 2),
    ("dp x tp = 2 x 2, SP, zero_stage 2", 2, 2, True, 2),
    ("dp x tp = 2 x 2, zero_stage 3", 2, 2, False, 3),
]


def toml_text(a, root, dp, tp, sp, zero):
    strategy = "single_device" if dp * tp == 1 else "model_parallel"
    strat = "" if dp * tp == 1 else f"\n[strategy]\ntensor_parallel_size = {tp}\nzero_stage = {zero}\ntimeout = 120\n"
    return f"""[plugins]
paths = ["{os.path.join(a.build, 'bench-plugins')}"]

[trainer]
accelerator = "cpu"
strategy = "{strategy}"
devices = {dp * tp}
precision = "32-true"
max_steps = {a.steps}
max_epochs = -1
limit_val_batches = 0
num_sanity_val_steps = 0
gradient_clip_val = 0.0
logger = false
enable_checkpointing = false
enable_progress_bar = false
enable_model_summary = false
seed = 42
default_root_dir = "{root}"
{strat}
[model]
name = "gpt"
block_size = {a.block_size}
n_layer = {a.n_layer}
n_head = {a.n_head}
n_embd = {a.n_embd}
dropout = 0.0
optimizer = "adamw"
lr = 1e-3
min_lr = 1e-3
warmup_steps = 0
lr_decay_steps = {a.steps}
sequence_parallel = {"true" if sp else "false"}

[data]
name = "char_corpus"
corpus = "{a.corpus}"
cache_dir = "{os.path.join(root, 'cache')}"
block_size = {a.block_size}
batch_size = {a.batch_size}
num_workers = 0
seed = 42

[[callbacks]]
name = "bench_step_probe"
memory = true
"""


def formulas(a, dp, tp, sp, zero=0):
    C, L, V, P = a.n_embd, a.n_layer, 256, a.block_size
    params = 4 * ((V + P) * C + 2 * C + L * (6 * C + (12 * C * C + 7 * C) // tp))
    E = a.batch_size * a.block_size * C
    # the blocks, then the head (replicated): ln_f's input and output, log_softmax's B*T*V output
    acts = 4 * L * ((2 * E + 15 * E // tp) if sp and tp > 1 else (4 * E + 13 * E // tp))
    acts += 4 * (2 * E + a.batch_size * a.block_size * V)
    S = 4 * E
    if tp == 1:
        tp_bytes = 0
    elif sp:
        tp_bytes = L * 8 * (tp - 1) * S // tp + 2 * (tp - 1) * S // tp
    else:
        tp_bytes = L * 4 * 2 * (tp - 1) * S // tp
    dp_bytes = (3 if zero == 1 else 2) * (dp - 1) * params // dp
    if zero == 3:  # the blocks gathered again for backward
        dp_bytes += (dp - 1) * (params - 4 * ((V + P) * C + 2 * C)) // dp
    return params, acts, tp_bytes + dp_bytes


def run(a, name, dp, tp, sp, zero):
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "tp.toml")
        with open(path, "w") as f:
            f.write(toml_text(a, root, dp, tp, sp, zero))
        env = dict(os.environ, OMP_NUM_THREADS="1", FULGUR_LOG_LEVEL="warn", FULGUR_SIGNAL_VOTE_EVERY="0")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        p = subprocess.run([a.fulgur, "fit", "--config", path], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{name}: fulgur fit failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    memory, wchar = {}, {}
    for line in p.stderr.splitlines():
        if m := MEM_RE.match(line):
            memory[int(m.group(1))] = [int(m.group(i)) for i in range(2, 6)]
        elif m := STEP_RE.match(line):
            wchar.setdefault(int(m.group(1)), {})[int(m.group(2))] = int(m.group(3))
    sent = {}
    for rank, steps in wchar.items():
        diffs = [steps[i + 1] - steps[i] for i in range(2, a.steps - 1) if i in steps and i + 1 in steps]
        sent[rank] = statistics.median(diffs) if diffs else float("nan")
    return memory[0], max(sent.values()) if sent else float("nan")


def kib(n):
    return f"{n / 1024:,.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fulgur", required=True)
    p.add_argument("--build", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    a = p.parse_args()
    print(f"GPT example: n_layer {a.n_layer}, n_embd {a.n_embd}, n_head {a.n_head}, block_size {a.block_size}, "
          f"{a.batch_size} rows per replica, float32, AdamW; rank 0's figures, KiB "
          f"(measured / formula); sent: the most any rank sent per step\n")
    print("| layout | parameters | gradients | AdamW state | activations | sent per step |")
    print("|---|---|---|---|---|---|")
    for name, dp, tp, sp, zero in CASES:
        (params, grads, optim, acts), sent = run(a, name, dp, tp, sp, zero)
        f_params, f_acts, f_sent = formulas(a, dp, tp, sp, zero)
        f_grads = f_params // dp if zero >= 1 else f_params
        f_optim = 2 * f_params // dp if zero >= 1 else 2 * f_params
        outside = 4 * ((256 + a.block_size) * a.n_embd + 2 * a.n_embd)  # embeddings and ln_f: whole
        f_held = f_params // dp + outside if zero == 3 else f_params
        print(f"| {name} | {kib(params)} / {kib(f_held)} | {kib(grads)} / {kib(f_grads)} | "
              f"{kib(optim)} / {kib(f_optim)} | {kib(acts)} / {kib(f_acts)} | {kib(sent)} / {kib(f_sent)} |",
              flush=True)


if __name__ == "__main__":
    main()
