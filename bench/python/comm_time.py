"""Communication alone (bench/distributed.py runs this for the hidden-under-backward share): N Gloo
ranks (torch.distributed, the same Gloo library Fulgur's c10d communicator uses), 1 thread each,
time the collectives one training step of a strategy issues on Ψ float32 parameters, with no
compute around them:

  ddp  all-reduce of the gradients in c10d's buckets (the first 1 MiB, then --bucket-cap-mb)
  z1   all-reduce of the gradients + all-gather of the updated parameters
  z2   reduce-scatter of the gradients + all-gather of the updated parameters
  z3   all-gather (forward) + all-gather (backward) + reduce-scatter, one call each per block
       (--blocks units, the rest in a root unit)

Prints one JSON object: {"kind": ms per step (median over --iters after 3 warm-up steps)}.
Flat tensors of the same sizes as the strategy's: the message sizes and counts match; packing
and copying around them (which Fulgur does on the compute threads) is not part of this time.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def sizes(kind, params, blocks, cap_mb, world):
    """(collective, numel) pairs for one step."""
    if kind == "ddp":
        out, left, first = [], params, min(1 << 20, cap_mb << 20) // 4
        take = min(left, first)
        out.append(("all_reduce", take))
        left -= take
        while left > 0:
            take = min(left, (cap_mb << 20) // 4)
            out.append(("all_reduce", take))
            left -= take
        return out
    pad = lambda n: (n + world - 1) // world * world
    if kind == "z1":
        return [("all_reduce", pad(params)), ("all_gather", pad(params))]
    if kind == "z2":
        return [("reduce_scatter", pad(params)), ("all_gather", pad(params))]
    # z3: per block a forward and a backward all-gather and a reduce-scatter; the root unit's
    # parameters (a third here: embeddings, final norm) are gathered after the step, as in stage 2.
    per_block = params * 2 // 3 // blocks
    root = params - per_block * blocks
    out = []
    for _ in range(blocks):
        out += [("all_gather", pad(per_block))] * 2 + [("reduce_scatter", pad(per_block))]
    return out + [("reduce_scatter", pad(root)), ("all_gather", pad(root))]


def worker(rank, world, store_path, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    result = {}
    for kind in args.kinds.split(","):
        plan = sizes(kind, args.params, args.blocks, args.bucket_cap_mb, world)
        bufs = [torch.randn(n) for _, n in plan]
        outs = [torch.empty(n // world) for _, n in plan]
        times = []
        for it in range(args.iters + 3):
            dist.barrier()
            t = time.perf_counter()
            for (op, n), b, o in zip(plan, bufs, outs):
                if op == "all_reduce":
                    dist.all_reduce(b)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(o, b)
                else:
                    dist.all_gather_into_tensor(b, o)
            if it >= 3:
                times.append(1000 * (time.perf_counter() - t))
        result[kind] = statistics.median(times)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, required=True, help="Ψ: trainable float32 parameters")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--kinds", default="ddp,z1,z2,z3")
    p.add_argument("--blocks", type=int, default=4, help="ZeRO-3 units (GPT blocks)")
    p.add_argument("--bucket-cap-mb", type=int, default=25)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store = os.path.join(tempfile.mkdtemp(prefix="fulgur-comm-"), "store")
    procs = [ctx.Process(target=worker, args=(r, args.ranks, store, args, queue)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    if any(pr.exitcode for pr in procs):
        sys.exit("comm_time: a rank failed")
    print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
