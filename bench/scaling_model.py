#!/usr/bin/env python3
"""A scaling model for the GPT example: step time and memory per rank of ddp, ZeRO-1/2/3, tensor
parallel (TP) and 2D (TP inside a node x ZeRO-3 across nodes) from 8 to 1024 ranks, for the GPT
scaled to 1B and 7B parameters, and where each strategy stops scaling. Plain Python (its
--measure-gloo mode uses torch from the project's venv).

  bench/scaling_model.py --measure-gloo                       Gloo all-reduce latency / bandwidth here (2 and 3 ranks)
  bench/scaling_model.py --calibration d.json [--gloo g.json] check against bench/distributed.sh --json d.json
  bench/scaling_model.py                                      the 8..1024-rank tables (published figures below)

The model (per optimizer step, per rank; Ψ parameters, N ranks, b tokens per rank):
  compute       6 Ψ b + 12 L T d b FLOPs (forward + backward; attention scores) at an assumed MFU
  collectives   ring all-reduce 2(N-1)/N S bytes, all-gather and reduce-scatter (N-1)/N S each, at the
                bus bandwidth of the slowest link the ring crosses, plus a latency term per collective
                (NCCL: rings for bandwidth, trees for latency: 2 log2 N hops)
  ddp           all-reduce of bf16 gradients (2Ψ), in 25 MB buckets under backward (overlappable)
  ZeRO-1 / 2    reduce-scatter of the gradients + all-gather of the parameters: the same volume as ddp
                (ZeRO paper, Rajbhandari et al. 2020, sec. 7); ZeRO-1's all-gather after the step
                cannot overlap backward, ZeRO-2's reduce-scatter can
  ZeRO-3        2 all-gathers of the parameters (forward, backward) + reduce-scatter: 1.5x ddp's
                volume, prefetched one unit ahead under compute
  TP (Megatron) 4 all-reduces of b d activations per layer (2 forward, 2 backward) on the critical
                path; a degree beyond one node's 8 GPUs crosses InfiniBand
  2D            TP of degree 8 inside each node x ZeRO-3 over the N/8 nodes
  memory        mixed-precision AdamW, bytes per parameter (ZeRO paper, K = 12): ddp 16Ψ,
                ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N, TP 16Ψ/t; activations
                s b h (34 + 5 a s / h) bytes per layer (Korthikanti et al. 2022, "Reducing
                Activation Recomputation in Large Transformer Models", eq. 1), divided by t under
                TP with sequence parallelism
  stops scaling at the first N where (a) the exposed communication exceeds the compute (scaling
                efficiency < 50%), (b) the memory per rank exceeds the GPU's 80 GB, or (c) for the
                data-parallel strategies the global batch N b exceeds a critical batch of 4 M tokens
                (GPT-3's largest batch was 3.2 M tokens: Brown et al. 2020, table 2.1), beyond which
                more replicas add no useful work.

Published figures used (not measured here):
  - NVIDIA H100 SXM: NVLink 4, 900 GB/s bidirectional per GPU = 450 GB/s each way; 989 TFLOP/s dense
    bf16 (NVIDIA H100 Tensor Core GPU datasheet, 2023). H200: the same NVLink and compute, 141 GB.
  - NDR InfiniBand: 400 Gb/s per port = 50 GB/s each way; DGX H100: 8 ConnectX-7 ports, one per GPU
    (NVIDIA DGX H100 user guide / ConnectX-7 datasheet).
  - NCCL reaches about 80% of the link in nccl-tests bus bandwidth for large all-reduces (NVIDIA
    nccl-tests README, "Performance" on busbw); latency per hop of a few microseconds (assumed: 5 us
    NVLink, 10 us InfiniBand).
  - MFU 40% assumed for the 1B/7B GPT on H100 (the order Megatron-LM / PaLM report).
"""

import argparse
import json
import math
import statistics
import os
import subprocess
import sys
import time

# ---- published / assumed hardware figures (see the docstring) -----------------------------------
H100 = {
    "name": "H100 SXM", "flops": 989e12, "mfu": 0.40, "mem": 80e9,
    "intra_bw": 0.80 * 450e9, "intra_lat": 5e-6,     # NVLink 4, each way, at nccl-tests' ~80%
    "inter_bw": 0.80 * 50e9, "inter_lat": 10e-6,     # NDR 400 Gb/s per GPU, each way
    "gpus_per_node": 8,
}
CRITICAL_BATCH_TOKENS = 4 * 2**20
BUCKET_BYTES = 25 * 2**20

MODELS = {
    # GPT-2 shape (examples/gpt scaled): n_layer, n_embd, n_head, context
    "1B": {"n_layer": 24, "n_embd": 2048, "n_head": 16, "T": 2048, "vocab": 50304},
    "7B": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "T": 2048, "vocab": 50304},
}


def params_of(m):
    d, L = m["n_embd"], m["n_layer"]
    return 12 * L * d * d + 13 * L * d + m["vocab"] * d + m["T"] * d


def flops_per_step(m, tokens):
    p = params_of(m) - m["vocab"] * m["n_embd"] - m["T"] * m["n_embd"]
    return 6 * p * tokens + 12 * m["n_layer"] * m["T"] * m["n_embd"] * tokens + 6 * m["vocab"] * m["n_embd"] * tokens


def link(n, hw):
    """Bus bandwidth and per-hop latency of a collective over n ranks packed 8 per node."""
    if n <= hw["gpus_per_node"]:
        return hw["intra_bw"], hw["intra_lat"]
    return hw["inter_bw"], hw["inter_lat"]


def t_allreduce(size, n, hw):
    if n <= 1:
        return 0.0
    bw, lat = link(n, hw)
    return 2 * (n - 1) / n * size / bw + 2 * math.log2(n) * lat * max(1, math.ceil(size / BUCKET_BYTES))


def t_gather(size, n, hw):  # all-gather or reduce-scatter of `size` bytes in all
    if n <= 1:
        return 0.0
    bw, lat = link(n, hw)
    return (n - 1) / n * size / bw + math.log2(n) * lat * max(1, math.ceil(size / BUCKET_BYTES))


def activations(m, micro_tokens, t=1):
    s, h, a = m["T"], m["n_embd"], m["n_head"]
    b = micro_tokens / s
    return m["n_layer"] * s * b * h * (34 + 5 * a * s / h) / t


def predict(strategy, m, n, hw, tokens_per_rank=8 * 2048, micro_tokens=2048):
    """(step seconds, compute seconds, exposed communication seconds, memory bytes per rank)."""
    psi = params_of(m)
    L, d = m["n_layer"], m["n_embd"]
    if strategy in ("ddp", "zero1", "zero2", "zero3"):
        compute = flops_per_step(m, tokens_per_rank) / (hw["flops"] * hw["mfu"])
        backward = compute * 2 / 3
        g = 2 * psi  # bf16 gradients / parameters on the wire
        if strategy == "ddp":
            comm, hidden = t_allreduce(g, n, hw), backward
            mem = 16 * psi
        elif strategy == "zero1":
            rs, ag = t_gather(g, n, hw), t_gather(g, n, hw)
            comm, hidden = rs + ag, min(backward, rs)  # the all-gather after the step is exposed
            mem = 4 * psi + 12 * psi / n
        elif strategy == "zero2":
            rs, ag = t_gather(g, n, hw), t_gather(g, n, hw)
            comm, hidden = rs + ag, min(backward, rs) + min(compute / 3, ag)  # next forward's gather
            mem = 2 * psi + 14 * psi / n
        else:
            comm, hidden = 3 * t_gather(g, n, hw), compute  # prefetched one unit ahead
            mem = 16 * psi / n + 2 * 2 * psi / L  # + two whole units in flight
        exposed = max(0.0, comm - hidden)
        # gradient accumulation keeps micro-batches small: activations of one micro-batch
        mem += activations(m, micro_tokens)
        return compute + exposed, compute, exposed, mem
    if strategy == "tp":
        # One replica over n ranks: the same global batch as n data-parallel ranks, split t ways.
        t = n
        compute = flops_per_step(m, tokens_per_rank * n) / n / (hw["flops"] * hw["mfu"])
        act_bytes = tokens_per_rank * n * d * 2  # bf16 activations of the whole batch
        comm = 4 * L * t_allreduce(act_bytes, t, hw) / 1  # on the critical path
        mem = 16 * psi / t + activations(m, micro_tokens * n, t)
        return compute + comm, compute, comm, mem
    if strategy == "2d":
        t = min(n, hw["gpus_per_node"])
        dp = n // t
        compute = flops_per_step(m, tokens_per_rank * t) / t / (hw["flops"] * hw["mfu"])
        act_bytes = tokens_per_rank * t * d * 2
        tp_comm = 4 * L * t_allreduce(act_bytes, t, hw)
        g = 2 * psi / t
        inter = dict(hw, gpus_per_node=1)  # data-parallel peers sit in other nodes
        zero_comm = 3 * t_gather(g, dp, inter)
        exposed = tp_comm + max(0.0, zero_comm - compute)
        mem = 16 * psi / (t * dp) + activations(m, micro_tokens * t, t)
        return compute + exposed, compute, exposed, mem
    raise ValueError(strategy)


def global_tokens(strategy, n, tokens_per_rank, hw):
    if strategy == "tp":
        return tokens_per_rank * n  # one replica: the same tokens as n data-parallel ranks (see predict)
    return tokens_per_rank * n


def stops(strategy, m, hw, ranks, tokens_per_rank):
    for n in ranks:
        step, compute, exposed, mem = predict(strategy, m, n, hw, tokens_per_rank)
        if mem > hw["mem"]:
            return n, f"memory {mem / 1e9:.0f} GB > {hw['mem'] / 1e9:.0f} GB"
        if exposed > compute:
            return n, f"communication {exposed * 1e3:.0f} ms > compute {compute * 1e3:.0f} ms"
        if strategy in ("ddp", "zero1", "zero2", "zero3", "2d"):
            replicas = n if strategy != "2d" else n // min(n, hw["gpus_per_node"])
            per_replica = tokens_per_rank if strategy != "2d" else tokens_per_rank * min(n, hw["gpus_per_node"])
            if replicas * per_replica > CRITICAL_BATCH_TOKENS:
                return n, f"global batch {replicas * per_replica / 2**20:.0f} M tokens > critical batch 4 M"
    return None, "scales to the last size shown"


def table(hw, tokens_per_rank):
    ranks = [8, 16, 32, 64, 128, 256, 512, 1024]
    strategies = ["ddp", "zero1", "zero2", "zero3", "tp", "2d"]
    for name, m in MODELS.items():
        psi = params_of(m)
        print(f"\n### GPT {name} ({psi / 1e9:.2f} B parameters, n_layer {m['n_layer']}, n_embd {m['n_embd']}), "
              f"{hw['name']}, {tokens_per_rank} tokens per rank per step\n")
        print("| strategy | " + " | ".join(f"{n}" for n in ranks) + " | stops scaling at |")
        print("|---|" + "---|" * len(ranks) + "---|")
        for s in strategies:
            cells = []
            for n in ranks:
                step, compute, exposed, mem = predict(s, m, n, hw, tokens_per_rank)
                eff = compute / step
                cells.append(f"{step * 1e3:.0f} ms, {mem / 1e9:.0f} GB, {100 * eff:.0f}%")
            at, why = stops(s, m, hw, ranks, tokens_per_rank)
            print(f"| {s} | " + " | ".join(cells) + f" | {at if at else '—'}: {why} |")
    print("\nCells: predicted step time, memory per rank (parameters, gradients, AdamW state, one micro-batch's "
          "activations), scaling efficiency (compute ÷ step). TP is one replica over all ranks.")


# ---- this machine: Gloo ----------------------------------------------------------------------------

GLOO_SIZES = [8, 4096, 65536, 262144, 1048576, 4194304]


def gloo_worker():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    import resource

    def cpu():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    out, cpu_out = {}, {}
    for size in GLOO_SIZES:
        x = torch.zeros(size // 4)
        for _ in range(3):
            dist.all_reduce(x)
        reps = 50 if size <= 65536 else 10
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu()
        for _ in range(reps):
            dist.all_reduce(x)
        out[size] = (time.perf_counter() - t0) / reps
        cpu_out[size] = (cpu() - c0) / reps
    if rank == 0:
        print("GLOO " + json.dumps({"ranks": n, "allreduce_s": out, "allreduce_cpu_s": cpu_out}), flush=True)
    dist.destroy_process_group()


def measure_gloo(n, python):
    env_base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + n), WORLD_SIZE=str(n),
                    OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, os.path.abspath(__file__), "--gloo-worker"], stdout=subprocess.PIPE, text=True,
                              env=dict(env_base, RANK=str(r))) for r in range(n)]
    outs = [p.communicate()[0] for p in procs]
    line = next(l for l in outs[0].splitlines() if l.startswith("GLOO "))
    res = json.loads(line[5:])
    times = {int(k): v for k, v in res["allreduce_s"].items()}
    cpu = {int(k): v for k, v in res["allreduce_cpu_s"].items()}
    # Fit t = a + (2(N-1)/N) S / bw (bytes each rank sends) by least squares over the sizes; the
    # CPU time of rank 0 the same way: CPU seconds per collective and per byte sent.
    def fit(values):
        xs = [2 * (n - 1) / n * s for s in values]
        ys = list(values.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return my - slope * mx, slope
    _, slope = fit(times)
    cpu0, cpu_slope = fit(cpu)
    return {"ranks": n, "latency_s": times[8], "bandwidth_Bps": 1 / slope, "allreduce_s": times,
            "cpu_per_collective_s": max(cpu0, cpu[8]), "cpu_per_byte_s": max(cpu_slope, 0.0), "allreduce_cpu_s": cpu}


def gloo_prediction(calib, gloo, n, cores):
    """Step time of each bench side on n Gloo ranks of this machine: one rank's compute (slowed by
    n / cores when the ranks outnumber the cores) plus the bytes each rank sent per step (measured
    by the bench; the formula where a side has no measurement) at the measured Gloo bandwidth, plus
    the measured latency per collective. No overlap: with one thread per rank on as many cores, no
    core is free to run Gloo's threads next to the compute, so their CPU work (measured per
    collective and per byte, slowed like the compute) adds to the step as well; with fewer ranks
    than cores it runs on a free core."""
    singles = [r["step_ms"] for r in calib["results"].get("fulgur-single") or []] or [calib["single"]["step_ms"]]
    single_ms = statistics.median(singles)
    params = calib["params"]
    L = calib["args"]["n_layer"]
    g = gloo[str(n)]
    bw, lat = g["bandwidth_Bps"], g["latency_s"]
    compute = single_ms / 1e3 * max(1.0, n / cores)
    f = (n - 1) / n * 4 * params
    sides = {  # formula bytes sent per rank (ring algorithms), collectives per step
        "fulgur-ddp": (2 * f, 2), "lightning-ddp": (2 * f, 2), "fulgur-z1": (3 * f, 3), "fulgur-z2": (2 * f, 3),
        "lightning-fsdp-grad-op": (2 * f, 2 * (L + 1)), "fulgur-z3": (3 * f, 3 * (L + 1)),
        "lightning-fsdp-full": (3 * f, 3 * (L + 1)),
    }
    single_cpu = statistics.median(r["cpu_ms"] for r in calib["results"].get("fulgur-single") or [calib["single"]])
    out = {}
    for side, (formula, collectives) in sides.items():
        runs = calib["results"].get(side) or []
        sent = [statistics.mean(v["bytes_per_step"] for v in r["ranks"].values()) for r in runs]
        b = statistics.median(sent) if sent else formula
        gloo_cpu = b * g["cpu_per_byte_s"] + collectives * g["cpu_per_collective_s"]
        cpu = single_cpu + 1e3 * gloo_cpu
        busy = gloo_cpu * n / cores if n >= cores else 0.0  # Gloo's threads on cores the compute fills
        out[side] = (1e3 * (compute + busy + b / bw + collectives * lat), cpu)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure-gloo", action="store_true", help="measure Gloo all-reduce on 2 and 3 local ranks")
    p.add_argument("--gloo", help="Gloo figures (JSON written by --measure-gloo --out)")
    p.add_argument("--out", help="--measure-gloo: write the figures here")
    p.add_argument("--calibration", action="append", default=[],
                   help="bench/distributed.sh --json output (2 or 3 ranks); repeat for both")
    p.add_argument("--tokens-per-rank", type=int, default=8 * 2048)
    p.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gloo_worker:
        return gloo_worker()
    if args.measure_gloo:
        res = {n: measure_gloo(n, sys.executable) for n in (2, 3)}
        for n, r in res.items():
            print(f"Gloo, {n} ranks on {os.cpu_count()} CPUs: latency (8-byte all-reduce) {r['latency_s'] * 1e6:.0f} us, "
                  f"bandwidth {r['bandwidth_Bps'] / 1e9:.2f} GB/s per rank sent; CPU {r['cpu_per_collective_s'] * 1e6:.0f} us "
                  f"per collective + {r['cpu_per_byte_s'] * 1e9:.2f} ns per byte sent; " +
                  ", ".join(f"{s} B: {t * 1e6:.0f} us" for s, t in r["allreduce_s"].items()))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({str(k): v for k, v in res.items()}, f, indent=1)
        return
    if args.calibration:
        if not args.gloo:
            sys.exit("--calibration needs --gloo (the figures of --measure-gloo --out)")
        with open(args.gloo) as f:
            gloo = json.load(f)
        print("| ranks | side | predicted ms/step (idle machine) | measured ms/step, median (range) | ÷ | "
              "predicted CPU ms/step/rank | measured CPU ms/step/rank | ÷ |")
        print("|---|---|---|---|---|---|---|---|")
        for path in args.calibration:
            with open(path) as f:
                calib = json.load(f)
            n = calib["args"]["ranks"]
            pred = gloo_prediction(calib, gloo, n, os.cpu_count())
            for side, runs in calib["results"].items():
                if not runs or side not in pred:
                    continue
                wall = [r["step_ms"] for r in runs]
                cpu = statistics.median(r["cpu_ms"] for r in runs)
                pw, pc = pred[side]
                m = statistics.median(wall)
                print(f"| {n} | {side} | {pw:.1f} | {m:.1f} ({min(wall):.1f}–{max(wall):.1f}) | {pw / m:.2f} | "
                      f"{pc:.1f} | {cpu:.1f} | {pc / cpu:.2f} |")
        return
    table(H100, args.tokens_per_rank)


if __name__ == "__main__":
    main()
