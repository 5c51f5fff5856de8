"""Captured steps (`[trainer] cuda_graphs`) and model FLOPs utilisation, side by side in one run
(bench/cuda_graphs.sh runs this; issue #12's targets):

  - Fulgur with cuda_graphs = "on" vs Fulgur uncaptured: throughput ratio (target >= 1.3 on the
    small GPT at batch 16, which is launch-bound on a GPU);
  - Fulgur vs the hand-written LibTorch loop: step-time ratio (target <= 1.02);
  - MFU of every side in bf16-mixed (target: Fulgur's within 2% of the loop's).

Every (case, precision, side, run) is one bench_compare process; runs are interleaved with the
side order rotated per run. MFU = model FLOPs per step x steps per second / the device's peak,
with the GPT's FLOPs per token 6 N + 12 L d S (N: parameters of its matrix multiplications,
embeddings excluded; L layers, width d, S tokens of context; forward and backward) and the peak
from the table Fulgur's throughput_monitor uses (plugins/callback/throughput_monitor/peak_flops.h,
read here so that there is one table). On a CPU the cuda_graphs side is refused by design and
shown as failed; MFU needs a GPU the table lists.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from compare import run_bench  # noqa: E402  (one way to run a side's process and read its result)

SIDES = {"raw": "LibTorch loop", "fulgur": "Fulgur", "fulgur-graphs": "Fulgur cuda_graphs"}


def peak_table():
    """(name_contains, {dtype: flops}) rows of peak_flops.h, in its order."""
    path = os.path.join(ROOT, "plugins", "callback", "throughput_monitor", "peak_flops.h")
    rows = []
    for m in re.finditer(r'\{"([a-z0-9 ]+)",\s*([0-9.e]+),\s*([0-9.e]+),\s*([0-9.e]+),\s*([0-9.e]+),\s*([0-9.e]+)\}',
                         open(path).read()):
        values = [float(v) for v in m.groups()[1:]]
        rows.append((m.group(1), dict(zip(["fp64", "fp32", "tf32", "bf16", "fp16"], values))))
    return rows


def peak_flops(device_name, key):
    name = device_name.lower()
    for contains, values in peak_table():
        if contains in name:
            return values[key] or None
    return None


def gpt_flops_per_step(batch):
    import models  # bench/python/models.py: the same GPT as bench_compare's
    model = models.make_model("gpt")
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "emb" not in name)
    tokens = batch * models.GPT_SEQ
    return tokens * (6 * n + 12 * models.GPT_LAYERS * models.GPT_DIM * models.GPT_SEQ)


def run_one(args, side, case, precision, root):
    model, batch, steps, warmup = case
    return run_bench([args.bench_compare, "--side", side, "--model", model, "--batch", str(batch), "--steps",
                      str(steps), "--warmup", str(warmup), "--device", args.device, "--threads", str(args.threads),
                      "--root", root, "--precision", precision], args.timeout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench-compare", required=True, help="path of the built bench_compare program")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test; the captured side is refused)")
    p.add_argument("--cases", default="gpt:16:300:30,gpt:64:200:20", help="model:batch:steps:warmup,...")
    p.add_argument("--precisions", default="32-true,bf16-mixed",
                   help="comma-separated, of 32-true, bf16-mixed and 16-mixed (the raw loop then reads the "
                        "inf check on the host each step, as a hand-written LibTorch loop does)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json", help="also write every run's result here")
    args = p.parse_args()
    cases = []
    for item in args.cases.split(","):
        m, b, s, w = item.split(":")
        cases.append((m, int(b), int(s), int(w)))
    precisions = [x for x in args.precisions.split(",") if x]
    sides = list(SIDES)
    device_name = "cpu"
    if args.device == "cuda":
        import torch
        device_name = torch.cuda.get_device_name(0)

    root = tempfile.mkdtemp(prefix="fulgur-graphs-")
    results = {(c, pr, s): [] for c in cases for pr in precisions for s in sides}
    errors = {}
    started = time.monotonic()
    try:
        for r in range(args.runs):
            for case in cases:
                for precision in precisions:
                    for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                        key = (case, precision, side)
                        if key in errors:
                            continue
                        print(f"cuda_graphs: run {r + 1}/{args.runs} {case[0]}:{case[1]} {precision} {side}",
                              file=sys.stderr, flush=True)
                        res = run_one(args, side, case, precision, os.path.join(root, f"{len(os.listdir(root))}"))
                        if "error" in res:
                            errors[key] = res["error"]
                            print(f"cuda_graphs: {side} failed: {res['error']}", file=sys.stderr)
                        else:
                            results[key].append(res)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"case": list(c), "precision": pr, "side": s, "runs": v, "error": errors.get((c, pr, s))}
                       for (c, pr, s), v in results.items()], f, indent=1)

    def med(key, field):
        runs = results[key]
        return statistics.median(r[field] for r in runs) if runs and key not in errors else None

    def ratio(a, b, field):
        ra, rb = results[a], results[b]
        if not ra or not rb or a in errors or b in errors:
            return "n/a"
        per_run = [x[field] / y[field] for x, y in zip(ra, rb)]
        return f"{med(a, field) / med(b, field):.3f} ({min(per_run):.3f}-{max(per_run):.3f})"

    print(f"\n## Captured steps (cuda_graphs) and MFU\n")
    print(f"device {args.device} ({device_name}), {args.runs} interleaved run(s), {time.monotonic() - started:.0f} s; "
          f"each figure the median over runs (per-run range in brackets).\n")
    print("| case | precision | " + " | ".join(f"{SIDES[s]} steps/s" for s in sides) +
          " | cuda_graphs / Fulgur (throughput) | Fulgur / loop (step time) | MFU loop | MFU Fulgur | MFU cuda_graphs "
          "| same first loss |")
    print("|---|---|" + "---:|" * (len(sides) + 5) + "---|")
    for case in cases:
        for precision in precisions:
            cells = []
            for s in sides:
                v = med((case, precision, s), "steps_per_s")
                cells.append(f"{v:.1f}" if v is not None else "failed")
            graphs = ratio((case, precision, "fulgur-graphs"), (case, precision, "fulgur"), "steps_per_s")
            step_time = ratio((case, precision, "fulgur"), (case, precision, "raw"), "median_step_us")
            mfu = []
            key = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision, "fp32")
            peak = peak_flops(device_name, key) if args.device == "cuda" else None
            for s in sides:
                v = med((case, precision, s), "steps_per_s")
                if peak and v is not None and case[0] == "gpt":
                    mfu.append(f"{100 * gpt_flops_per_step(case[1]) * v / peak:.2f}%")
                else:
                    mfu.append("n/a")
            # Same data, weights and dropout masks on every side: the loss before any step must agree.
            firsts = [r["first_loss"] for s in sides for r in results[(case, precision, s)]]
            same = "n/a" if len(firsts) < 2 else (
                "yes" if max(firsts) - min(firsts) <= 1e-5 * max(1.0, abs(max(firsts))) else
                f"NO ({min(firsts):.6g} to {max(firsts):.6g})")
            print(f"| {case[0]}:{case[1]} | {precision} | " + " | ".join(cells) + f" | {graphs} | {step_time} | " +
                  " | ".join(mfu) + f" | {same} |")
    if errors:
        print("\nFailed sides:\n")
        for (case, precision, side), why in errors.items():
            print(f"- {case[0]}:{case[1]} {precision} {side}: {why}")
    print("\nTargets (issue #12): cuda_graphs / Fulgur >= 1.3 on gpt:16; Fulgur / loop step time <= 1.02; "
          "Fulgur's bf16 MFU within 2% of the loop's (relative).")


if __name__ == "__main__":
    main()
