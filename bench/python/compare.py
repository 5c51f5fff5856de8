"""Fulgur side by side with a hand-written LibTorch loop, a plain PyTorch loop and PyTorch Lightning,
on the same models, data, initial weights, optimizer and machine (bench/compare.sh runs this).

Every (case, side, run) is its own process, so time to first step and peak RSS are per process.
Runs are interleaved: run r executes every case once with the sides in an order rotated by r, so a
slow phase of the machine hits every side alike. A ratio between two sides is printed only after
checking that they did the same work (same steps, same data and initial weights, same first loss,
same final loss within TOLERANCES).

Across languages the float32 final loss cannot decide that: C++ and Python Adam round differently,
and a few ulps per step grow through training (past 2e-3 on the CNN with dropout within 40 steps).
So every side also runs each case once in float64 (--dtype float64, the same program with the
Trainer's "64-true" precision), where that rounding is ~1e-16 per step and stays below 1e-9 after
the same growth, while a real difference in the work (a missed or extra step, other data, dropout
masks or learning rate) moves the loss by 1e-3 or more. Cross-language pairs must agree there.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# side -> (language, label)
SIDES = {
    "raw": ("C++", "LibTorch loop"),
    "fulgur": ("C++", "Fulgur"),
    "fulgur-bare": ("C++", "Fulgur barebones"),
    "plain": ("Python", "PyTorch loop"),
    "lightning": ("Python", "Lightning"),
    "lightning-bare": ("Python", "Lightning barebones"),
}

# (model, batch, steps, warmup). The transformer (vocab 256, 2 layers, d_model 128, 4 heads, 64
# tokens) runs batches of 16 and 64 sequences (1024 and 4096 tokens a step): on a CPU that is
# already compute-bound; on a GPU pass e.g. --cases gpt:64:300:20,gpt:256:200:20.
DEFAULT_CASES = [
    ("mlp", 64, 1500, 50),
    ("mlp", 256, 600, 30),
    ("cnn", 64, 40, 5),
    ("cnn", 256, 20, 4),
    ("gpt", 16, 40, 5),
    ("gpt", 64, 20, 4),
]
QUICK_CASES = [("mlp", 64, 30, 5), ("cnn", 64, 6, 2), ("gpt", 16, 6, 2)]

# Same-work check. The first loss is computed before any optimizer step from bit-identical data,
# weights and dropout masks: it must match (to float32 rounding of its printout). The final loss
# may differ across languages by rounding only: C++ torch::optim::Adam and Python's Adam order
# their float operations differently (mul+add vs lerp), which drifts by a few ulps per step.
# Differences are taken as |a - b| / max(1, |a|, |b|) (absolute for losses below one).
TOLERANCES = {
    "first_loss": 1e-6,  # relative, every pair
    "final_loss_same_language": 1e-4,  # relative (bit-identical on the CPU; GPU atomics may differ)
    "final_loss_cross_language": 2e-3,  # relative, float32: reported, decides only with --no-verify
    "final_loss_float64": 1e-7,  # relative, every pair, in the float64 verification run
    "checksum": 1e-12,  # relative, data and initial weights
}

# The ratios the issue sets targets for: (numerator side, denominator side).
PAIRS = [
    ("fulgur", "raw"),
    ("fulgur-bare", "raw"),
    ("fulgur", "lightning"),
    ("fulgur-bare", "lightning-bare"),
    ("fulgur", "plain"),
    ("lightning", "plain"),
    ("lightning-bare", "plain"),
]


def parse_cases(text):
    cases = []
    for item in text.split(","):
        parts = item.split(":")
        model, batch = parts[0], int(parts[1])
        steps = int(parts[2]) if len(parts) > 2 else 100
        warmup = int(parts[3]) if len(parts) > 3 else max(1, min(10, steps // 5))
        cases.append((model, batch, steps, warmup))
    return cases


def command(args, side, case, root, dtype="float32"):
    model, batch, steps, warmup = case
    common = ["--side", side, "--model", model, "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup),
              "--pool", str(args.pool), "--device", args.device, "--threads", str(args.threads), "--root", root,
              "--dtype", dtype]
    if SIDES[side][0] == "C++":
        return [args.bench_compare] + common
    script = "plain_loop.py" if side == "plain" else "lightning_bench.py"
    return [sys.executable, os.path.join(HERE, script)] + common


def run_one(args, side, case, root, dtype="float32"):
    """One process; returns its BENCH_RESULT dict or {"error": text}."""
    return run_bench(command(args, side, case, root, dtype), args.timeout)


def run_bench(cmd, timeout):
    """Runs one side's process (bench_compare or a Python side; --spawn-ns is appended) and returns
    its BENCH_RESULT dict or {"error": text, "cmd": ...}. bench/python/cuda_graphs.py uses it too."""
    env = dict(os.environ, FULGUR_LOG_LEVEL=os.environ.get("FULGUR_LOG_LEVEL", "warn"), PYTHONWARNINGS="ignore")
    spawn_ns = time.monotonic_ns()  # the clock both languages read at their first step
    try:
        p = subprocess.run(cmd + ["--spawn-ns", str(spawn_ns)], capture_output=True, text=True, env=env,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in p.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT "):])
    lines = [l for l in (p.stderr or "").splitlines() if l.strip()]
    # bench_compare's own message line, else the last line (a Python traceback's exception).
    mine = [l for l in lines if l.startswith("bench_compare: error:")]
    why = mine[0] if mine else lines[-1] if lines else "no output"
    return {"error": f"exit {p.returncode}: {why}", "cmd": " ".join(cmd)}


def rel_diff(a, b):
    return abs(a - b) / max(1.0, abs(a), abs(b))


def same_work(case, a_runs, b_runs, a, b, verify=None):
    """(ok, reason, max final-loss difference) for two sides' runs of one case.

    verify: the float64 runs {side: result} of the case, or None (--no-verify). With them, a
    cross-language pair is judged on its float64 final losses; the float32 ones are only reported.
    """
    steps = case[2]
    worst = 0.0
    cross = SIDES[a][0] != SIDES[b][0]
    tol_final = TOLERANCES["final_loss_cross_language" if cross else "final_loss_same_language"]
    if verify is not None:
        va, vb = verify.get(a), verify.get(b)
        if not va or not vb:
            return False, "no float64 verification run", worst
        if va["steps"] != steps or vb["steps"] != steps:
            return False, f"float64 steps {va['steps']} vs {vb['steps']} (expected {steps})", worst
        d64 = rel_diff(va["final_loss"], vb["final_loss"])
        if not d64 <= TOLERANCES["final_loss_float64"]:
            return False, (f"float64 final loss {va['final_loss']} vs {vb['final_loss']} "
                           f"(tolerance {TOLERANCES['final_loss_float64']:g})"), worst
        if cross:
            tol_final = float("inf")  # decided in float64 above; NaN still fails below
    for ra in a_runs:
        for rb in b_runs:
            if ra["steps"] != steps or rb["steps"] != steps:
                return False, f"steps {ra['steps']} vs {rb['steps']} (expected {steps})", worst
            for key in ("data_sum", "init_sum"):
                if rel_diff(ra[key], rb[key]) > TOLERANCES["checksum"]:
                    return False, f"{key} {ra[key]} vs {rb[key]}", worst
            if rel_diff(ra["first_loss"], rb["first_loss"]) > TOLERANCES["first_loss"]:
                return False, f"first loss {ra['first_loss']} vs {rb['first_loss']}", worst
            d = rel_diff(ra["final_loss"], rb["final_loss"])
            worst = max(worst, d)
            if not d <= tol_final or d != d:  # also catches NaN
                return False, f"final loss {ra['final_loss']} vs {rb['final_loss']} (tolerance {tol_final:g})", worst
    return True, "", worst


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench-compare", help="path of the built bench_compare program (needed unless --load)")
    p.add_argument("--runs", type=int, default=5, help="interleaved runs per case and side (default 5)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (every side; Fulgur needs a 'cuda' accelerator plugin)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads on every side (0: torch's default)")
    p.add_argument("--cases", help="model:batch[:steps[:warmup]],... (default: %s)" %
                   ",".join(f"{m}:{b}:{s}:{w}" for m, b, s, w in DEFAULT_CASES))
    p.add_argument("--sides", default=",".join(SIDES), help="subset of " + ",".join(SIDES))
    p.add_argument("--quick", action="store_true", help="few steps per case (smoke test)")
    p.add_argument("--pool", type=int, default=16, help="distinct batches served cyclically (default 16)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per process")
    p.add_argument("--json", help="also write every run's raw result here")
    p.add_argument("--load", help="print the tables for a --json file of an earlier run instead of running")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the float64 verification runs (cross-language pairs then need the float32 tolerance)")
    args = p.parse_args()
    if not args.bench_compare and not args.load:
        p.error("--bench-compare PATH is needed (bench/compare.sh passes it)")
    cases = parse_cases(args.cases) if args.cases else QUICK_CASES if args.quick else DEFAULT_CASES
    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s not in SIDES:
            p.error(f"unknown side '{s}'; choose from {', '.join(SIDES)}")

    root = tempfile.mkdtemp(prefix="fulgur-compare-")
    results = {(c, s): [] for c in cases for s in sides}
    verify = {c: {} for c in cases}
    errors = {}
    load_before = os.getloadavg()
    started = time.monotonic()
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        cases = list(dict.fromkeys(tuple(e["case"]) for e in saved))
        sides = list(dict.fromkeys(e["side"] for e in saved))
        results = {(tuple(e["case"]), e["side"]): e["runs"] for e in saved}
        verify = {c: {} for c in cases}
        for e in saved:
            if e.get("float64"):
                verify[tuple(e["case"])][e["side"]] = e["float64"]
        args.runs = 0
    try:
        if not args.no_verify and not args.load:
            for case in cases:
                for side in sides:
                    print(f"compare: float64 verification {case[0]} batch {case[1]} {side}", file=sys.stderr, flush=True)
                    res = run_one(args, side, case, os.path.join(root, f"{case[0]}{case[1]}-{side}-f64"), "float64")
                    if "error" in res:
                        print(f"compare: {side} float64 run failed: {res['error']}", file=sys.stderr)
                    else:
                        verify[case][side] = res
        for r in range(args.runs):
            for case in cases:
                order = sides[r % len(sides):] + sides[:r % len(sides)]
                for side in order:
                    if (case, side) in errors:
                        continue
                    print(f"compare: run {r + 1}/{args.runs} {case[0]} batch {case[1]} {side}",
                          file=sys.stderr, flush=True)
                    res = run_one(args, side, case, os.path.join(root, f"{case[0]}{case[1]}-{side}-{r}"))
                    if "error" in res:
                        errors[(case, side)] = res["error"]
                        print(f"compare: {side} failed: {res['error']}\n  {res.get('cmd', '')}", file=sys.stderr)
                    else:
                        results[(case, side)].append(res)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - started
    load_after = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"case": list(c), "side": s, "runs": v, "float64": verify[c].get(s)}
                       for (c, s), v in results.items()], f, indent=1)

    ok = {key: bool(v) and key not in errors for key, v in results.items()}
    any_run = next((v[0] for v in results.values() if v), {})
    import torch  # only for its version string; the sides imported it themselves

    print(f"\n## Fulgur vs LibTorch loop, PyTorch loop and Lightning\n")
    if args.load:
        print(f"(Tables re-rendered from {args.load}; the load average and duration below are of now.)\n")
    print(f"torch {torch.__version__}, device {args.device}, {any_run.get('threads', '?')} intra-op thread(s), "
          f"{os.cpu_count()} CPU(s), load average {load_before[0]:.1f} before / {load_after[0]:.1f} after, "
          f"{max(map(len, results.values()), default=0)} interleaved run(s), {elapsed:.0f} s. Adam lr 1e-3, "
          f"same seeded data and initial weights on every side. Each figure is the median over runs of one "
          f"process each.\n")

    # Throughput and per-step overhead.
    print("### Steps per second (timed window after warmup, device synchronised at both ends)\n")
    print("| model | batch | steps | " + " | ".join(SIDES[s][1] for s in sides) + " |")
    print("|---|---:|---:|" + "---:|" * len(sides))
    for case in cases:
        cells = [fmt(med(results[(case, s)], "steps_per_s"), 1) if ok[(case, s)] else "failed" for s in sides]
        print(f"| {case[0]} | {case[1]} | {case[2]} | " + " | ".join(cells) + " |")

    checks = {}
    for case in cases:
        for a, b in PAIRS:
            if a in sides and b in sides and ok[(case, a)] and ok[(case, b)]:
                checks[(case, a, b)] = same_work(case, results[(case, a)], results[(case, b)], a, b,
                                                 None if args.no_verify or not any(verify[case].values())
                                                 else verify[case])

    def ratio_cell(case, a, b, key, invert=False, digits=3):
        """Median of a's key over median of b's (invert: b over a), or why there is none."""
        if (case, a, b) not in checks:
            return "n/a"
        good, reason, _ = checks[(case, a, b)]
        if not good:
            return "withheld"
        x, y = med(results[(case, a)], key), med(results[(case, b)], key)
        return fmt(y / x if invert else x / y, digits)

    def spread_cell(case, a, b):
        """Per-run step-time ratio a/b, min-max: runs ran back to back, so this shows the noise."""
        if (case, a, b) not in checks or not checks[(case, a, b)][0]:
            return "-"
        v = [rb["steps_per_s"] / ra["steps_per_s"] for ra, rb in zip(results[(case, a)], results[(case, b)])]
        return f"{min(v):.3f}-{max(v):.3f}"

    print("\n### Ratios\n")
    print("Step time ratios are the inverse of the steps/s ratio: > 1 means slower than the baseline. "
          "\"median step\" uses each run's median single step (robust to preemption), \"CPU\" the process "
          "CPU time per step (all threads), which other load on the machine inflates far less than wall time.\n")
    print("| model | batch | Fulgur/LibTorch step time | per-run range | median step | CPU | Fulgur bare/LibTorch "
          "| Fulgur÷Lightning steps/s | CPU | bare÷bare steps/s | Fulgur÷PyTorch loop steps/s "
          "| Lightning/PyTorch loop step time | same work |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for case in cases:
        mine = [(a, b, v) for (c, a, b), v in checks.items() if c == case]
        failures = [f"NO: {a} vs {b}: {reason}" for a, b, (good, reason, _) in mine if not good]
        worst = max((w for _, _, (_, _, w) in mine), default=0.0)
        pairs64 = [rel_diff(verify[case][a]["final_loss"], verify[case][b]["final_loss"]) for a, b, _ in mine
                   if verify[case].get(a) and verify[case].get(b)]
        d64 = f", float64 Δ {max(pairs64):.1e}" if pairs64 else ""
        verdict = ("<br>".join(failures) if failures else f"yes, {len(mine)} pairs (max Δ {worst:.1e}{d64})"
                   if mine else "-")
        print(f"| {case[0]} | {case[1]} "
              f"| {ratio_cell(case, 'fulgur', 'raw', 'steps_per_s', invert=True)} "
              f"| {spread_cell(case, 'fulgur', 'raw')} "
              f"| {ratio_cell(case, 'fulgur', 'raw', 'median_step_us')} "
              f"| {ratio_cell(case, 'fulgur', 'raw', 'cpu_us_per_step')} "
              f"| {ratio_cell(case, 'fulgur-bare', 'raw', 'steps_per_s', invert=True)} "
              f"| {ratio_cell(case, 'fulgur', 'lightning', 'steps_per_s', digits=2)} "
              f"| {ratio_cell(case, 'fulgur', 'lightning', 'cpu_us_per_step', invert=True, digits=2)} "
              f"| {ratio_cell(case, 'fulgur-bare', 'lightning-bare', 'steps_per_s', digits=2)} "
              f"| {ratio_cell(case, 'fulgur', 'plain', 'steps_per_s', digits=2)} "
              f"| {ratio_cell(case, 'lightning', 'plain', 'steps_per_s', invert=True, digits=2)} "
              f"| {verdict} |")

    print("\n### Per-step overhead over the hand-written loop of the same language (µs)\n")
    print("Each cell: wall / CPU. Wall: framework step time minus loop step time (1e6 / steps/s); CPU: the "
          "same from process CPU time per step. Negative values are noise.\n")
    print("| model | batch | LibTorch loop µs/step | Fulgur +µs | Fulgur bare +µs | PyTorch loop µs/step "
          "| Lightning +µs | Lightning bare +µs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def us(case, side, key):
        if not ok.get((case, side)):
            return None
        return 1e6 / med(results[(case, side)], "steps_per_s") if key == "wall" else med(results[(case, side)], key)

    def pair_us(case, side, base=None):
        cells = []
        for key in ("wall", "cpu_us_per_step"):
            a = us(case, side, key)
            b = us(case, base, key) if base else 0.0
            cells.append(None if a is None or b is None else a - b)
        return f"{fmt(cells[0], 1)} / {fmt(cells[1], 1)}"

    for case in cases:
        print(f"| {case[0]} | {case[1]} | {pair_us(case, 'raw')} | {pair_us(case, 'fulgur', 'raw')} "
              f"| {pair_us(case, 'fulgur-bare', 'raw')} | {pair_us(case, 'plain')} "
              f"| {pair_us(case, 'lightning', 'plain')} | {pair_us(case, 'lightning-bare', 'plain')} |")

    print("\n### Process start to first training step (ms) and peak RSS (MiB)\n")
    print("From just before the process is spawned to the start of the first step: loading the runtime "
          "(libtorch; Python, `import torch`, `import lightning`), building data and model, and the "
          "Trainer's setup (config, plugin discovery and loading, loggers, callbacks).\n")
    print("| model | batch | " + " | ".join(SIDES[s][1] for s in sides) + " | Fulgur÷Lightning | "
          + " | ".join(f"RSS {SIDES[s][1]}" for s in sides) + " |")
    print("|---|---:|" + "---:|" * (2 * len(sides) + 1))
    for case in cases:
        first = [fmt(med(results[(case, s)], "first_step_ms"), 0) if ok[(case, s)] else "failed" for s in sides]
        rss = [fmt(med(results[(case, s)], "peak_rss_mib"), 0) if ok[(case, s)] else "-" for s in sides]
        startup = "n/a"
        if ok.get((case, "fulgur")) and ok.get((case, "lightning")):
            startup = fmt(med(results[(case, "fulgur")], "first_step_ms")
                          / med(results[(case, "lightning")], "first_step_ms"), 3)
        print(f"| {case[0]} | {case[1]} | " + " | ".join(first) + f" | {startup} | " + " | ".join(rss) + " |")

    # Targets of the issue.
    def target_row(name, values, goal, better_low):
        vals = [v for v in values if v is not None]
        if not vals:
            return f"| {name} | {goal} | n/a | - |"
        worst = max(vals) if better_low else min(vals)
        met = all((v <= float(goal[2:]) if better_low else v >= float(goal[2:])) for v in vals)
        return f"| {name} | {goal} | {', '.join(f'{v:.3f}' for v in values if v is not None)} (worst {worst:.3f}) " \
               f"| {'met' if met else 'NOT met'} |"

    def ratio_value(case, a, b, key, invert):
        cell = ratio_cell(case, a, b, key, invert)
        return float(cell) if cell not in ("n/a", "withheld") else None

    print("\n### Targets\n")
    print("| target | goal | measured (per case) | status |\n|---|---|---|---|")
    print(target_row("Fulgur / LibTorch loop step time, all cases",
                     [ratio_value(c, "fulgur", "raw", "steps_per_s", True) for c in cases], "<=1.02", True))
    print(target_row("Fulgur / LibTorch loop CPU time per step, all cases",
                     [ratio_value(c, "fulgur", "raw", "cpu_us_per_step", False) for c in cases], "<=1.02", True))
    print(target_row("Fulgur ÷ Lightning throughput, MLP",
                     [ratio_value(c, "fulgur", "lightning", "steps_per_s", False) for c in cases if c[0] == "mlp"],
                     ">=2.0", False))
    print(target_row("Fulgur ÷ Lightning throughput, transformer",
                     [ratio_value(c, "fulgur", "lightning", "steps_per_s", False) for c in cases if c[0] == "gpt"],
                     ">=1.0", False))
    print(target_row("Fulgur ÷ Lightning time to first step",
                     [med(results[(c, "fulgur")], "first_step_ms") / med(results[(c, "lightning")], "first_step_ms")
                      for c in cases if ok.get((c, "fulgur")) and ok.get((c, "lightning"))], "<=0.2", True))
    print(f"\nSame-work tolerances, as |a - b| / max(1, |a|, |b|): first loss {TOLERANCES['first_loss']:g}, final loss "
          f"{TOLERANCES['final_loss_same_language']:g} within a language and "
          f"{TOLERANCES['final_loss_cross_language']:g} across C++/Python (Adam rounding) unless the float64 "
          f"verification ran: then every pair must agree within {TOLERANCES['final_loss_float64']:g} in float64 "
          f"and the float32 final loss of a cross-language pair is only reported; data and initial "
          f"weight checksums {TOLERANCES['checksum']:g}. \"max Δ\" is the largest relative float32 final-loss "
          f"difference seen between the two sides of any pair, over all runs; \"float64 Δ\" the largest in the "
          f"verification runs.")

    failed = [f"{c[0]}{c[1]} {s}: {e}" for (c, s), e in errors.items()]
    for f in failed:
        print(f"\nfailed: {f}")
    if failed or any(not good for good, _, _ in checks.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
