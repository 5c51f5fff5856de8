"""The real example end to end: build/bin/fashion_mnist with examples/fashion_mnist/fashion_mnist.toml
against the same program under Lightning (real_lightning.py), on the Fashion-MNIST files
(bench/real.sh runs this).

Each (model, side, run) is one process measured from outside: wall time of each training epoch
(train + end-of-epoch validation, printed by both programs), and from wait4() the process's user
and system CPU time, minor page faults and peak RSS (the whole process: data loading, fit and test).
Runs are interleaved (run r takes the sides in an order rotated by r), so a slow phase of a
shared machine hits every side alike; the tables give medians and min-max ranges.

Sides besides `fulgur` and `lightning` measure the host-memory candidates of issue #16 on the
same binary: `fulgur-glibc` opts out of Fulgur's malloc settings (FULGUR_HOST_MALLOC=system: the
program as it was before the fix), `fulgur-jemalloc` / `-mimalloc` / `-tcmalloc` opt out and
preload the Debian allocator (what linking it into the host would give), `fulgur-tunables` opts
out and sets the equivalent GLIBC_TUNABLES (the issue's diagnosis), `fulgur-caching` opts out and
preloads a caching c10 CPU allocator (bench/caching_cpu_allocator.cpp).
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
LIBDIR = "/usr/lib/x86_64-linux-gnu"
PRELOADS = {
    "fulgur-jemalloc": "libjemalloc.so.2",
    "fulgur-mimalloc": "libmimalloc.so.2",
    "fulgur-tcmalloc": "libtcmalloc_minimal.so.4",
}
TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
# Built next to fashion_mnist (bench/caching_cpu_allocator.cpp), found in <build>/lib.
CACHING_LIB = "libfulgur_bench_caching_allocator.so"
SIDES = ["fulgur", "lightning", "fulgur-glibc", "fulgur-tunables"] + list(PRELOADS) + ["fulgur-caching"]
LABELS = {
    "fulgur": "Fulgur",
    "lightning": "Lightning",
    "fulgur-glibc": "Fulgur, glibc defaults (before)",
    "fulgur-tunables": "Fulgur, GLIBC_TUNABLES",
    "fulgur-jemalloc": "Fulgur + jemalloc",
    "fulgur-mimalloc": "Fulgur + mimalloc",
    "fulgur-tcmalloc": "Fulgur + tcmalloc",
    "fulgur-caching": "Fulgur + caching CPU allocator",
}


def fulgur_toml(args, arch, root):
    """The example's TOML with only the run length, model and output directory changed."""
    with open(os.path.join(REPO, "examples", "fashion_mnist", "fashion_mnist.toml")) as f:
        text = f.read()
    text = re.sub(r"(?m)^max_epochs = .*$", f"max_epochs = {args.epochs}", text)
    text = re.sub(r'(?m)^default_root_dir = .*$', f'default_root_dir = "{root}"', text)
    text = re.sub(r'(?m)^name = "fashion_mnist_(cnn|mlp)".*$', f'name = "fashion_mnist_{arch}"', text)
    if args.limit_batches:
        text = text.replace("[trainer]\n", f"[trainer]\nlimit_train_batches = {args.limit_batches}\n"
                            f"limit_val_batches = {args.limit_batches}\nlimit_test_batches = {args.limit_batches}\n", 1)
    path = os.path.join(root, "fashion_mnist.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def command(args, side, arch, root):
    env = dict(os.environ, FULGUR_LOG_LEVEL=os.environ.get("FULGUR_LOG_LEVEL", "warn"), PYTHONWARNINGS="ignore")
    env.pop("FULGUR_HOST_MALLOC", None)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # both sides read it at startup
    if side == "lightning":
        cmd = [sys.executable, os.path.join(HERE, "real_lightning.py"), "--arch", arch, "--epochs", str(args.epochs),
               "--data", args.data, "--root", root]
        if args.limit_batches:
            cmd += ["--limit-train-batches", str(args.limit_batches)]
        return cmd, env
    if side != "fulgur":
        env["FULGUR_HOST_MALLOC"] = "system"
    if side == "fulgur-tunables":
        env["GLIBC_TUNABLES"] = TUNABLES
    if side in PRELOADS:
        env["LD_PRELOAD"] = os.path.join(LIBDIR, PRELOADS[side])
    if side == "fulgur-caching":
        env["LD_PRELOAD"] = caching_lib(args)
    return [args.fulgur, "--config", fulgur_toml(args, arch, root)], env


def caching_lib(args):
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.fulgur))), "lib", CACHING_LIB)


def run_one(args, side, arch, root):
    os.makedirs(root, exist_ok=True)
    cmd, env = command(args, side, arch, root)
    start = time.monotonic()
    with open(os.path.join(root, "stdout.txt"), "w+") as out, open(os.path.join(root, "stderr.txt"), "w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=root)
        # wait4 gives this child's own rusage (not summed with earlier children as RUSAGE_CHILDREN is).
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        out.seek(0)
        text = out.read()
        err.seek(0)
        err_text = err.read()
    epochs = [float(m) for m in re.findall(r"(?m)^epoch \d+: ([0-9.]+) s", text)]
    if p.returncode != 0 or not epochs:
        lines = [l for l in err_text.splitlines() if l.strip()]
        return {"error": f"exit {p.returncode}: {lines[-1] if lines else 'no epoch time printed'}",
                "cmd": " ".join(cmd)}
    acc = re.search(r"test accuracy: ([0-9.]+)%", text)
    res = re.search(r"(?m)^REAL_RESULT (.*)$", text)
    test_acc = float(acc.group(1)) / 100 if acc else json.loads(res.group(1)).get("test_acc") if res else None
    cpu = ru.ru_utime + ru.ru_stime
    return {
        "epoch_s": statistics.mean(epochs),
        "wall_s": wall,
        "cpu_s": cpu,
        "sys_s": ru.ru_stime,
        "sys_share": ru.ru_stime / cpu if cpu else 0.0,
        "minflt": ru.ru_minflt,
        "majflt": ru.ru_majflt,
        "rss_mib": ru.ru_maxrss / 1024.0,
        "test_acc": test_acc,
    }


def stat(runs, key):
    v = [r[key] for r in runs]
    return statistics.median(v), min(v), max(v)


def cell(runs, key, digits, scale=1.0):
    if not runs:
        return "failed"
    m, lo, hi = stat(runs, key)
    return f"{m * scale:.{digits}f} ({lo * scale:.{digits}f}–{hi * scale:.{digits}f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fulgur", required=True, help="path of build/bin/fashion_mnist")
    p.add_argument("--runs", type=int, default=5, help="interleaved runs per model and side (default 5)")
    p.add_argument("--models", default="cnn,mlp", help="cnn,mlp (the example's two archs)")
    p.add_argument("--sides", default="fulgur,lightning,fulgur-glibc", help="subset of " + ",".join(SIDES))
    p.add_argument("--epochs", type=int, default=1, help="max_epochs of every run (default 1)")
    p.add_argument("--limit-batches", type=int, default=0, help="batches per stage (0: all; smoke tests: a few)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every side (0: each default)")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--json", help="also write every run's raw result here")
    args = p.parse_args()
    args.fulgur = os.path.abspath(args.fulgur)  # the runs start in their own directories
    sides = [s for s in args.sides.split(",") if s]
    for s in sides:
        if s not in SIDES:
            p.error(f"unknown side '{s}'; choose from {', '.join(SIDES)}")
        if s in PRELOADS and not os.path.exists(os.path.join(LIBDIR, PRELOADS[s])):
            p.error(f"side {s} needs {LIBDIR}/{PRELOADS[s]} (Debian package of that allocator)")
        if s == "fulgur-caching" and not os.path.exists(caching_lib(args)):
            p.error(f"side {s} needs {caching_lib(args)} (build target fulgur_bench_caching_allocator)")
    models = [m for m in args.models.split(",") if m]

    root = tempfile.mkdtemp(prefix="fulgur-real-")
    results = {(m, s): [] for m in models for s in sides}
    errors = {}
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        for r in range(args.runs):
            for m in models:
                for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                    if (m, s) in errors:
                        continue
                    print(f"real: run {r + 1}/{args.runs} {m} {s}", file=sys.stderr, flush=True)
                    res = run_one(args, s, m, os.path.join(root, f"{m}-{s}-{r}"))
                    if "error" in res:
                        errors[(m, s)] = res["error"]
                        print(f"real: {s} failed: {res['error']}\n  {res['cmd']}", file=sys.stderr)
                    else:
                        results[(m, s)].append(res)
                        print(f"real:   epoch {res['epoch_s']:.1f} s, cpu {res['cpu_s']:.1f} s, sys {res['sys_s']:.2f} s, "
                              f"{res['minflt']} faults, {res['rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": m, "side": s, "runs": v} for (m, s), v in results.items()], f, indent=1)

    load_after = os.getloadavg()
    print(f"\n## Fashion-MNIST example, Fulgur vs Lightning ({args.epochs} epoch(s), batch 64, Adam)\n")
    print(f"{os.cpu_count()} CPU(s), load average {load_before[0]:.1f} before / {load_after[0]:.1f} after, "
          f"{args.runs} interleaved run(s), {time.monotonic() - started:.0f} s"
          + (f", OMP_NUM_THREADS={args.threads}" if args.threads else "")
          + (f", {args.limit_batches} batches per stage (smoke run)" if args.limit_batches else "")
          + ". Median (min–max) over runs; CPU, system time, page faults and peak RSS are the whole process "
            "(load, fit, test) from wait4().\n")
    print("| model | side | epoch s | CPU s | system s | sys/CPU % | minor faults (k) | peak RSS MiB | test acc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in models:
        for s in sides:
            runs = results[(m, s)]
            acc = f"{statistics.median(r['test_acc'] for r in runs):.4f}" if runs and runs[0]["test_acc"] else "-"
            print(f"| {m} | {LABELS[s]} | {cell(runs, 'epoch_s', 1)} | {cell(runs, 'cpu_s', 1)} | {cell(runs, 'sys_s', 2)} "
                  f"| {cell(runs, 'sys_share', 1, 100)} | {cell(runs, 'minflt', 0, 1e-3)} | {cell(runs, 'rss_mib', 0)} "
                  f"| {acc} |")

    print("\n### Ratios to Lightning (median of per-pair ratios, min–max; pairs ran back to back)\n")
    print("| model | side | epoch | CPU | system | page faults | peak RSS |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m in models:
        base = results.get((m, "lightning"), [])
        for s in sides:
            if s == "lightning" or not base or not results[(m, s)]:
                continue
            cells = []
            for key in ("epoch_s", "cpu_s", "sys_s", "minflt", "rss_mib"):
                v = [a[key] / b[key] for a, b in zip(results[(m, s)], base) if b[key]]
                cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})" if v else "-")
            print(f"| {m} | {LABELS[s]} | " + " | ".join(cells) + " |")
    for (m, s), e in errors.items():
        print(f"\nfailed: {m} {s}: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
