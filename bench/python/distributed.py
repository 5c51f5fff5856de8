"""Distributed speed side by side (bench/distributed.sh runs this): the GPT example on 2 Gloo ranks,
Fulgur `ddp` and `fsdp` zero_stage 1/2/3 (`fulgur fit` with a TOML) against Lightning 2.6.6 `ddp`
and FSDP2 (ModelParallelStrategy, fully_shard: FULL_SHARD and SHARD_GRAD_OP) on the same model
written in Python (gpt_lightning.py).

Same work on both sides: Fulgur writes its initial weights once (bench_step_probe save_init, from
a single-process run that also measures the compute time of one step), Lightning loads them; both
read Fulgur's token file in the same order (randperm seeded like Fulgur's sampler, dealt
rank::world); AdamW with the same groups and a constant learning rate; float32; no clipping, no
validation, no logger, no checkpoints; 1 intra-op thread per rank (OMP_NUM_THREADS=1). Before any
ratio, the per-rank losses of the first steps of every side must agree with Fulgur ddp's.

Every rank of every side prints one FULGUR_STEP line per training batch (bench_step_probe /
gpt_lightning.Probe): CLOCK_MONOTONIC time, loss, bytes written (/proc/self/io wchar: Gloo writes
its TCP traffic with writev, so in the steady state this is the bytes sent), peak RSS and page
faults of that rank. Step time: median of rank 0's step-to-step intervals after the first
--warmup steps. Runs are interleaved (run r takes the sides in an order rotated by r); medians
with min-max ranges.

Communication hidden under compute: the collectives of each strategy alone (comm_time.py) next to
what the ranks add to one process's step; with --overlap, one more run of each Fulgur side under
the `pytorch` profiler plugin, whose traces give the share of each Gloo collective's in-flight
time during which the training thread computed (overlap.py). --bucket-cap-mb sets ddp's buckets,
--reduce-bucket-mb fsdp stage 1/2's; a side `fulgur-z2-blocking` (any fsdp side + `-blocking`) runs
with overlap_reduce = false: the hidden share before and after the overlap.

--model cnn runs the Fashion-MNIST example's CNN instead (examples/fashion_mnist: its model and
datamodule plugins, Adam), Fulgur sides only: ddp and ZeRO-1/2 against each other and one process
(the Lightning side for it is not written; ZeRO-3 refuses a model without blocks).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

FULGUR_SIDES = {"fulgur-ddp": ("ddp", None), "fulgur-z1": ("fsdp", 1), "fulgur-z2": ("fsdp", 2),
                "fulgur-z3": ("fsdp", 3)}
LIGHTNING_SIDES = {"lightning-ddp": "ddp", "lightning-fsdp-full": "fsdp_full",
                   "lightning-fsdp-grad-op": "fsdp_grad_op"}
LABELS = {
    "fulgur-single": "Fulgur, 1 process (compute only)",
    "fulgur-ddp": "Fulgur ddp", "fulgur-z1": "Fulgur fsdp zero_stage 1", "fulgur-z2": "Fulgur fsdp zero_stage 2",
    "fulgur-z3": "Fulgur fsdp zero_stage 3", "lightning-ddp": "Lightning DDPStrategy",
    "lightning-fsdp-full": "Lightning FSDP2 FULL_SHARD", "lightning-fsdp-grad-op": "Lightning FSDP2 SHARD_GRAD_OP",
}
# Fulgur side -> the Lightning side it is compared with (ZeRO-1 has no Lightning counterpart: ddp).
PAIRS = [("fulgur-ddp", "lightning-ddp"), ("fulgur-z1", "lightning-ddp"), ("fulgur-z2", "lightning-fsdp-grad-op"),
         ("fulgur-z3", "lightning-fsdp-full")]
NOVOTE = "-novote"  # suffix of a Fulgur side: FULGUR_SIGNAL_VOTE_EVERY=0
BLOCKING = "-blocking"  # suffix of a Fulgur fsdp side: [strategy] overlap_reduce = false
STEP_RE = re.compile(r"^FULGUR_STEP rank=(\d+) step=(\d+) t=([\d.]+) loss=([-\d.eE+naif]+) wchar=(-?\d+) "
                     r"rss_kib=(\d+) minflt=(\d+) cpu=([\d.]+)", re.M)


# --overlap: the `pytorch` profiler plugin records 4 steps after the warm-up (overlap.py reads them).
PROFILER = """[profiler]
name = "pytorch"
dirpath = "{root}/trace"
wait = {warmup}
warmup = 1
active = 4
"""


# --model cnn: the Fashion-MNIST example's CNN (examples/fashion_mnist) with its datamodule and Adam.
CNN_TABLES = """[model]
name = "fashion_mnist_cnn"
optimizer = "adam"
lr = {lr}
weight_decay = 0.0

[data]
name = "fashion_mnist"
dir = "{data}"
batch_size = {batch_size}
num_workers = 0
val_split = 5000
seed = 42
"""


def model_tables(args):
    if args.model == "cnn":
        return CNN_TABLES.format(lr=args.lr, data=args.fashion_mnist, batch_size=args.batch_size)
    return f"""[model]
name = "gpt"
block_size = {args.block_size}
n_layer = {args.n_layer}
n_head = {args.n_head}
n_embd = {args.n_embd}
dropout = 0.0
optimizer = "adamw"
lr = {args.lr}
min_lr = {args.lr}
weight_decay = 0.1
betas = [0.9, 0.99]
warmup_steps = 0
lr_decay_steps = {args.steps}

[data]
name = "char_corpus"
corpus = "{args.corpus}"
cache_dir = "{args.cache}"
max_bytes = {args.max_bytes}
val_fraction = 0.1
block_size = {args.block_size}
batch_size = {args.batch_size}
num_workers = 0
seed = 42

"""


def toml_text(args, root, strategy, stage, devices, save_init="", profile=False, blocking=False):
    plugin_dir = os.path.join(args.build, "bench-plugins")
    model_tables_text = model_tables(args)
    strat = ""
    if strategy == "fsdp":
        strat = f"\n[strategy]\nzero_stage = {stage}\n"
        if blocking:
            strat += "overlap_reduce = false\n"
        elif args.reduce_bucket_mb is not None and stage in (1, 2):
            strat += f"reduce_bucket_mb = {args.reduce_bucket_mb}\n"
    elif strategy == "ddp" and args.bucket_cap_mb is not None:
        strat = f"\n[strategy]\nbucket_cap_mb = {args.bucket_cap_mb}\n"
    return f"""[plugins]
paths = ["{plugin_dir}"]

[trainer]
accelerator = "cpu"
strategy = "{strategy}"
devices = {devices}
precision = "32-true"
max_steps = {args.steps}
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
{PROFILER.format(root=root, warmup=args.warmup) if profile else ""}
{model_tables_text}
[[callbacks]]
name = "bench_step_probe"
save_init = "{save_init}"
"""


def command(args, side, root, profile=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               FULGUR_LOG_LEVEL=os.environ.get("FULGUR_LOG_LEVEL", "warn"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if side.endswith(NOVOTE):
        # The same Fulgur side without the per-batch signal vote (a measurement switch).
        env["FULGUR_SIGNAL_VOTE_EVERY"] = "0"
        side = side[: -len(NOVOTE)]
    blocking = side.endswith(BLOCKING)
    side = side.removesuffix(BLOCKING)
    if side in FULGUR_SIDES:
        strategy, stage = FULGUR_SIDES[side]
        path = os.path.join(root, "bench.toml")
        with open(path, "w") as f:
            f.write(toml_text(args, root, strategy, stage, args.ranks, profile=profile, blocking=blocking))
        return [args.fulgur, "fit", "--config", path], env
    if side == "fulgur-single":
        path = os.path.join(root, "bench.toml")
        with open(path, "w") as f:
            f.write(toml_text(args, root, "single_device", None, 1, save_init=args.init))
        return [args.fulgur, "fit", "--config", path], env
    cmd = [sys.executable, os.path.join(HERE, "gpt_lightning.py"), "--strategy", LIGHTNING_SIDES[side],
           "--devices", str(args.ranks), "--steps", str(args.steps), "--tokens", args.tokens, "--init", args.init,
           "--block-size", str(args.block_size), "--batch-size", str(args.batch_size), "--n-layer",
           str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd), "--lr", str(args.lr)]
    if profile:
        cmd += ["--trace", os.path.join(root, "trace"), "--trace-wait", str(args.warmup)]
    return cmd, env


def run_one(args, side, root):
    os.makedirs(root, exist_ok=True)
    cmd, env = command(args, side, root)
    start = time.monotonic()
    with open(os.path.join(root, "out.txt"), "w+") as out:
        p = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root,
                           timeout=args.timeout)
        wall = time.monotonic() - start
        out.seek(0)
        text = out.read()
    ranks = {}
    for m in STEP_RE.finditer(text):
        r = int(m.group(1))
        ranks.setdefault(r, []).append({"step": int(m.group(2)), "t": float(m.group(3)), "loss": float(m.group(4)),
                                        "wchar": int(m.group(5)), "rss_kib": int(m.group(6)),
                                        "minflt": int(m.group(7)), "cpu": float(m.group(8))})
    want = 1 if side == "fulgur-single" else args.ranks
    if p.returncode != 0 or len(ranks) != want or any(len(v) != args.steps for v in ranks.values()):
        tail = "\n".join(l for l in text.splitlines() if "FULGUR_STEP" not in l)[-1500:]
        return {"error": f"exit {p.returncode}, {len(ranks)} rank(s) reported: {tail}", "cmd": " ".join(cmd)}
    w = args.warmup
    res = {"wall_s": wall, "ranks": {}}
    for r, steps in sorted(ranks.items()):
        steps.sort(key=lambda s: s["step"])
        dts = [b["t"] - a["t"] for a, b in zip(steps[w:], steps[w + 1:])]
        sent = [b["wchar"] - a["wchar"] for a, b in zip(steps[w:], steps[w + 1:])]
        cpu = [b["cpu"] - a["cpu"] for a, b in zip(steps[w:], steps[w + 1:])]
        res["ranks"][r] = {"step_ms": 1000 * statistics.median(dts), "bytes_per_step": statistics.median(sent),
                           "cpu_ms": 1000 * statistics.mean(cpu),
                           "rss_mib": steps[-1]["rss_kib"] / 1024, "minflt": steps[-1]["minflt"],
                           "first_step_s": steps[0]["t"] - start, "losses": [s["loss"] for s in steps]}
    res["step_ms"] = res["ranks"][0]["step_ms"]
    res["cpu_ms"] = statistics.mean(v["cpu_ms"] for v in res["ranks"].values())
    res["first_step_s"] = max(v["first_step_s"] for v in res["ranks"].values())
    return res


def stat(values):
    return statistics.median(values), min(values), max(values)


def fmt_range(values, digits=1, scale=1.0):
    m, lo, hi = stat([v * scale for v in values])
    return f"{m:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def formula_bytes(side, params, n):
    """Bytes a rank sends per step by the textbook algorithms (ring all-reduce 2(N-1)/N, all-gather
    and reduce-scatter (N-1)/N of the float32 parameters)."""
    side = side[: -len(NOVOTE)] if side.endswith(NOVOTE) else side.removesuffix(BLOCKING)
    b = 4 * params * (n - 1) / n
    return {"fulgur-ddp": 2 * b, "lightning-ddp": 2 * b, "fulgur-z1": 3 * b, "fulgur-z2": 2 * b,
            "lightning-fsdp-grad-op": 2 * b, "fulgur-z3": 3 * b, "lightning-fsdp-full": 3 * b}.get(side, 0.0)


FORMULA_TEXT = {"fulgur-ddp": "all-reduce 2(N−1)/N·4Ψ", "lightning-ddp": "all-reduce 2(N−1)/N·4Ψ",
                "fulgur-z1": "all-reduce + all-gather 3(N−1)/N·4Ψ", "fulgur-z2": "reduce-scatter + all-gather 2(N−1)/N·4Ψ",
                "lightning-fsdp-grad-op": "all-gather + reduce-scatter 2(N−1)/N·4Ψ",
                "fulgur-z3": "2 all-gathers + reduce-scatter 3(N−1)/N·4Ψ",
                "lightning-fsdp-full": "2 all-gathers + reduce-scatter 3(N−1)/N·4Ψ"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fulgur", required=True, help="build/bin/fulgur")
    p.add_argument("--build", required=True, help="the build directory (its bench-plugins/ holds bench_step_probe)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs per side (default 3)")
    p.add_argument("--sides", default=",".join(["fulgur-single"] + list(FULGUR_SIDES) + list(LIGHTNING_SIDES)),
                   help="fulgur-single, fulgur-ddp, fulgur-z1..3, lightning-ddp, lightning-fsdp-full, "
                        "lightning-fsdp-grad-op; a Fulgur side + '-novote' runs it with FULGUR_SIGNAL_VOTE_EVERY=0")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    p.add_argument("--check-steps", type=int, default=5, help="steps whose losses must agree")
    p.add_argument("--tolerance", type=float, default=2e-3, help="largest |loss difference| allowed")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--model", choices=["gpt", "cnn"], default="gpt",
                   help="gpt: the GPT example (every side); cnn: the Fashion-MNIST example's CNN (Adam, batch "
                        "--batch-size, lr --lr), Fulgur sides fulgur-single/ddp/z1/z2 only (no Lightning side "
                        "written for it yet; ZeRO-3 refuses it: no blocks)")
    p.add_argument("--fashion-mnist", default="/usr/share/datasets/fashion-mnist", help="--model cnn: the IDX files")
    p.add_argument("--corpus", default="/usr/share/games/fortunes")
    p.add_argument("--max-bytes", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--bucket-cap-mb", type=int, help="Fulgur ddp's bucket_cap_mb (default: the strategy's, 25)")
    p.add_argument("--reduce-bucket-mb", type=float,
                   help="Fulgur fsdp zero_stage 1/2's reduce_bucket_mb (default: the strategy's, 25)")
    p.add_argument("--no-comm", action="store_true", help="skip timing the collectives alone (hidden share)")
    p.add_argument("--overlap", action="store_true",
                   help="one more run of each side under the profiler (Fulgur: signal vote off; Lightning: "
                        "torch.profiler): the share of its collectives' time hidden under compute (overlap.py)")
    p.add_argument("--json", help="also write the raw results here (bench/scaling_model.py --calibration reads it)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    if args.model == "cnn":
        for s in (x for x in args.sides.split(",") if x):
            base = s.removesuffix(NOVOTE).removesuffix(BLOCKING)
            if base in LIGHTNING_SIDES or base == "fulgur-z3":
                p.error(f"--model cnn: side '{s}' is not available (Lightning: not written; ZeRO-3: the CNN has no "
                        "blocks); choose among fulgur-single, fulgur-ddp, fulgur-z1, fulgur-z2")
    args.fulgur = os.path.abspath(args.fulgur)
    args.build = os.path.abspath(args.build)
    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s.endswith(BLOCKING) and s.removesuffix(BLOCKING) in FULGUR_SIDES and "fsdp" in FULGUR_SIDES[s.removesuffix(BLOCKING)]:
            LABELS[s] = LABELS[s.removesuffix(BLOCKING)] + ", overlap_reduce = false"
            continue
        if s.endswith(NOVOTE) and s[: -len(NOVOTE)] in FULGUR_SIDES:
            LABELS[s] = LABELS[s[: -len(NOVOTE)]] + ", no signal vote"
            continue
        if s not in FULGUR_SIDES and s not in LIGHTNING_SIDES and s != "fulgur-single":
            p.error(f"unknown side '{s}'; choose from {', '.join(list(FULGUR_SIDES) + list(LIGHTNING_SIDES))}")

    root = tempfile.mkdtemp(prefix="fulgur-distributed-")
    args.cache = os.path.join(root, "tokens")
    args.init = os.path.join(root, "init.safetensors")
    load_before = os.getloadavg()
    started = time.monotonic()
    results = {s: [] for s in sides}
    errors = {}
    try:
        # Once: the token files and the initial weights, and one rank's compute time per step.
        print("distributed: single-process run (initial weights, token files, compute per step)", file=sys.stderr)
        single = run_one(args, "fulgur-single", os.path.join(root, "single"))
        if "error" in single:
            sys.exit(f"distributed: the single-process Fulgur run failed: {single['error']}\n  {single['cmd']}")
        args.tokens = next((os.path.join(d, "train.bin") for d, _, files in os.walk(args.cache) if "train.bin" in files),
                           None)
        params = sum(_numel(args.init))
        comm = {} if args.no_comm else comm_alone(args, params)
        for r in range(args.runs):
            for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                if s in errors:
                    continue
                print(f"distributed: run {r + 1}/{args.runs} {s}", file=sys.stderr, flush=True)
                res = run_one(args, s, os.path.join(root, f"{s}-{r}"))
                if "error" in res:
                    errors[s] = res["error"]
                    print(f"distributed: {s} failed: {res['error']}\n  {res['cmd']}", file=sys.stderr)
                    continue
                results[s].append(res)
                print(f"distributed:   {res['step_ms']:.1f} ms/step, first step after {res['first_step_s']:.1f} s, "
                      f"{res['ranks'][0]['bytes_per_step'] / 1e6:.2f} MB sent/step, "
                      f"{max(v['rss_mib'] for v in res['ranks'].values()):.0f} MiB", file=sys.stderr, flush=True)
        overlap = {}
        for s in sides if args.overlap else []:
            if (s.removesuffix(BLOCKING) in FULGUR_SIDES or s in LIGHTNING_SIDES) and s not in errors:
                print(f"distributed: {s} under the profiler (hidden share)", file=sys.stderr, flush=True)
                overlap[s] = profiled_overlap(args, s, os.path.join(root, f"{s}-trace"))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"distributed: run directories kept in {root}", file=sys.stderr)
    load_after = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
                       "params": params, "single": single, "comm_ms": comm, "overlap": overlap, "results": results, "errors": errors}, f, indent=1)
    report(args, sides, results, errors, single, params, load_before, load_after, time.monotonic() - started, comm, overlap)


# Side -> the comm_time.py kind whose collectives it issues per step.
COMM_KIND = {"fulgur-ddp": "ddp", "lightning-ddp": "ddp", "fulgur-z1": "z1", "fulgur-z2": "z2",
             "lightning-fsdp-grad-op": "z2", "fulgur-z3": "z3", "lightning-fsdp-full": "z3"}


def comm_alone(args, params):
    """ms per step of each strategy's collectives alone on args.ranks Gloo ranks (comm_time.py)."""
    print("distributed: timing the collectives alone (comm_time.py)", file=sys.stderr, flush=True)
    cmd = [sys.executable, os.path.join(HERE, "comm_time.py"), "--params", str(params), "--ranks", str(args.ranks),
           "--blocks", str(args.n_layer), "--bucket-cap-mb", str(args.bucket_cap_mb or 25)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if p.returncode != 0:
        print(f"distributed: comm_time.py failed, no hidden share: {p.stderr[-500:]}", file=sys.stderr)
        return {}
    return json.loads(p.stdout.strip().splitlines()[-1])


def profiled_overlap(args, side, root):
    """Hidden share of one profiled run of a side, per rank (overlap.py), or {"error": ...}: Fulgur under its
    `pytorch` profiler plugin, Lightning under torch.profiler (gpt_lightning.py --trace), the same scopes."""
    import overlap as ov
    os.makedirs(root, exist_ok=True)
    cmd, env = command(args, side, root, profile=True)
    env["FULGUR_SIGNAL_VOTE_EVERY"] = "0"  # only the gradient and parameter collectives
    with open(os.path.join(root, "out.txt"), "w") as out:
        p = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root,
                           timeout=args.timeout)
    traces = sorted(os.path.join(root, "trace", f) for f in os.listdir(os.path.join(root, "trace"))
                    if f.endswith(".pt.trace.json")) if os.path.isdir(os.path.join(root, "trace")) else []
    if p.returncode != 0 or len(traces) != args.ranks:
        return {"error": f"exit {p.returncode}, {len(traces)} trace(s)"}
    return {"ranks": [ov.analyse(t) for t in traces]}


def hidden_share(step_ms, single_ms, comm_ms):
    """1 − exposed / communication, exposed = step time − one process's compute-only step time."""
    return 1.0 - (step_ms - single_ms) / comm_ms


def _numel(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    for k, v in header.items():
        if k != "__metadata__":
            count = 1
            for d in v["shape"]:
                count *= d
            yield count


def report(args, sides, results, errors, single, params, load_before, load_after, seconds, comm=None, overlap=None):
    n = args.ranks
    if args.model == "cnn":
        print(f"\n## Fashion-MNIST CNN on {n} Gloo ranks: Fulgur ddp and fsdp\n")
        what = "examples/fashion_mnist CNN, 28x28 images"
    else:
        print(f"\n## GPT example on {n} Gloo ranks: Fulgur vs Lightning 2.6.6\n")
        what = f"n_layer {args.n_layer}, n_embd {args.n_embd}, block {args.block_size}"
    print(f"Ψ = {params / 1e6:.3f} M parameters ({what}), "
          f"batch {args.batch_size} per rank, float32, {'Adam' if args.model == 'cnn' else 'AdamW'}, {args.steps} steps (step time over steps "
          f"{args.warmup + 1}–{args.steps}), 1 thread per rank, {os.cpu_count()} CPUs, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after, {args.runs} interleaved run(s), {seconds:.0f} s. "
          f"Median (min–max) over runs. '− 1 process': the median step minus the median step of one process "
          f"with one thread doing one rank's work (what communication and sharing the cores add).\n")
    # Same work first.
    ref_side = "fulgur-ddp" if results.get("fulgur-ddp") else next((s for s in sides if results.get(s)), None)
    agree = {}
    if ref_side:
        ref = results[ref_side][0]["ranks"]
        k = args.check_steps
        for s in sides:
            if not results.get(s) or s == "fulgur-single":  # one rank reads other windows
                continue
            diff = max(abs(a - b) for res in results[s] for r in ref
                       for a, b in zip(res["ranks"][r]["losses"][:k], ref[r]["losses"][:k]))
            agree[s] = diff
        first = " / ".join(f"{x:.4f}" for x in ref[0]["losses"][:k])
        print(f"Same work: rank 0's first {k} losses under {LABELS[ref_side]}: {first}; largest difference of any "
              f"side, rank and run from them: "
              + ", ".join(f"{LABELS[s]} {d:.1e}" for s, d in agree.items()) + f" (tolerance {args.tolerance:g}).\n")
    ok = {s for s, d in agree.items() if d <= args.tolerance}
    for s in sides:
        if s in agree and s not in ok:
            print(f"**{LABELS[s]}: losses differ by {agree[s]:.2e} > {args.tolerance}: not the same work, no ratio.**\n")
    singles = [r["step_ms"] for r in results.get("fulgur-single") or []] or [single["step_ms"]]
    single_ms = statistics.median(singles)
    print("| side | ms/step | − 1 process ms | CPU ms/step/rank | peak RSS MiB per rank (max over ranks) | "
          "page faults per rank | MB sent/step/rank measured | formula | start to first step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in sides:
        runs = results.get(s)
        if not runs:
            print(f"| {LABELS[s]} | failed: {errors.get(s, 'no run')[:80]} | | | | | | | |")
            continue
        rss = [max(v["rss_mib"] for v in r["ranks"].values()) for r in runs]
        flt = [max(v["minflt"] for v in r["ranks"].values()) for r in runs]
        sent = [statistics.mean(v["bytes_per_step"] for v in r["ranks"].values()) for r in runs]
        print(f"| {LABELS[s]} | {fmt_range([r['step_ms'] for r in runs])} | "
              f"{statistics.median(r['step_ms'] for r in runs) - single_ms:+.1f} | "
              f"{fmt_range([r['cpu_ms'] for r in runs])} | {fmt_range(rss, 0)} | "
              f"{fmt_range(flt, 0)} | {fmt_range(sent, 3, 1e-6)} | {formula_bytes(s, params, n) / 1e6:.3f} "
              f"({FORMULA_TEXT.get(s.removesuffix(NOVOTE).removesuffix(BLOCKING), '')}) | {fmt_range([r['first_step_s'] for r in runs], 1)} |")
    print("\n| Fulgur ÷ Lightning | step time | CPU time per step | peak RSS (max rank) | start to first step |")
    print("|---|---|---|---|---|")
    for f, l in PAIRS:
        if f not in ok or l not in ok or not results.get(f) or not results.get(l):
            continue
        fr, lr = results[f], results[l]
        # Ratios of runs paired by round (interleaved: the same phase of the machine).
        ratio = lambda key: [a[key] / b[key] for a, b in zip(fr, lr)]
        rss = [max(v["rss_mib"] for v in a["ranks"].values()) / max(v["rss_mib"] for v in b["ranks"].values())
               for a, b in zip(fr, lr)]
        print(f"| {LABELS[f]} ÷ {LABELS[l]} | {fmt_range(ratio('step_ms'), 2)} | {fmt_range(ratio('cpu_ms'), 2)} | "
              f"{fmt_range(rss, 2)} | "
              f"{fmt_range(ratio('first_step_s'), 2)} |")
    kind = lambda s: COMM_KIND.get(s.removesuffix(NOVOTE).removesuffix(BLOCKING))
    hid = [s for s in sides if results.get(s) and (comm or {}).get(kind(s))]
    if hid:
        print("\n| communication hidden under compute | collectives alone ms/step | step − 1 process ms | hidden |")
        print("|---|---|---|---|")
        for s in hid:
            c = comm[kind(s)]
            shares = [hidden_share(r["step_ms"], single_ms, c) for r in results[s]]
            print(f"| {LABELS[s]} | {c:.2f} | "
                  f"{fmt_range([r['step_ms'] - single_ms for r in results[s]], 1)} | {fmt_range(shares, 0, 100)} % |")
        print("\nHidden = 1 − (step time − one process's compute-only step time) ÷ (the same collectives alone, "
              "bench/python/comm_time.py, on the same ranks); 100 % = communication costs nothing, 0 % = fully "
              "exposed, below 0 = the ranks also slow each other's compute (sharing the cores).")
    if overlap:
        print("\n| hidden under compute, from the profiler's intervals (overlap.py) | hidden per rank | "
              "collectives per step | their in-flight ms/step per rank | backward ms/step per rank |")
        print("|---|---|---|---|---|")
        for s, o in overlap.items():
            if "error" in o:
                print(f"| {LABELS[s]} | failed: {o['error']} | | | |")
                continue
            rk = o["ranks"]
            per_rank = lambda key, fmt: " / ".join(fmt.format(r[key]) for r in rk)
            print(f"| {LABELS[s]} | {per_rank('hidden', '{:.0%}')} | "
                  f"{rk[0]['collectives'] / max(rk[0]['steps'], 1):.0f} | "
                  f"{per_rank('comm_ms', '{:.1f}')} | {per_rank('backward_ms', '{:.1f}')} |")
        print("\nHidden = the part of each Gloo collective's in-flight interval (its worker thread, start to done) "
              "during which the training thread ran an ATen operator, summed over 4 recorded steps ÷ the summed "
              "intervals; signal vote off. In-flight time includes waiting for the slower rank.")
    votes = [s for s in sides if s.endswith(NOVOTE) and results.get(s) and results.get(s[: -len(NOVOTE)])]
    if votes:
        print("\n| signal vote (one asynchronous 8-byte max-all-reduce per batch) | step time with ÷ without | "
              "ms/step with − without | CPU ms/step/rank with − without |")
        print("|---|---|---|---|")
        for s in votes:
            with_vote, without = results[s[: -len(NOVOTE)]], results[s]
            print(f"| {LABELS[s[: -len(NOVOTE)]]} | "
                  f"{fmt_range([a['step_ms'] / b['step_ms'] for a, b in zip(with_vote, without)], 3)} | "
                  f"{fmt_range([a['step_ms'] - b['step_ms'] for a, b in zip(with_vote, without)], 1)} | "
                  f"{fmt_range([a['cpu_ms'] - b['cpu_ms'] for a, b in zip(with_vote, without)], 2)} |")


if __name__ == "__main__":
    main()
