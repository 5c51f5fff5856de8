"""Share of communication hidden under compute, from a LibTorch profiler trace (the `pytorch`
profiler plugin's Chrome trace of one rank; bench/distributed.py --overlap runs Fulgur with it).

Gloo runs every collective on its own worker thread and the profiler records it there as one
`gloo:<op>` interval, from the moment the worker starts it to the moment it is done, whether the
training thread launched it asynchronously (c10d's Reducer from a gradient hook, a ZeRO-3
prefetch) or waits on it at once. The training thread (the one that runs `backward`) computes
during its ATen operators. So, per collective:

    hidden = length of (its gloo interval ∩ the union of the training thread's aten:: intervals)

and the share is Σ hidden ÷ Σ gloo interval lengths over the recorded steps. A collective the
training thread blocks on has no ATen operator running beside it: 0 % hidden. One all-reduced
after backward is over while the optimizer has not started: 0 %. A bucket all-reduced while
backward computes the next gradients: hidden. (The profiler slows the ATen operators somewhat,
which lengthens the compute a collective can hide under: an upper bound by a few percent.)

  python overlap.py TRACE.json [...]     prints {"hidden": share, "comm_ms": ..., "steps": n} per file
"""

import bisect
import json
import sys


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def covered(merged, starts, s, e):
    """Length of [s, e] covered by the sorted disjoint intervals `merged`."""
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < e:
        total += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return total


def analyse(path):
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    backward = [e for e in events if e.get("name") == "backward" and e.get("cat") == "user_annotation"]
    if not backward:
        raise SystemExit(f"{path}: no 'backward' scope (not a Fulgur trace of training steps?)")
    main = backward[0]["tid"]
    compute = union((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e["tid"] == main and e.get("cat") == "cpu_op" and e["name"].startswith("aten::"))
    starts = [s for s, _ in compute]
    comm = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["name"].startswith("gloo:")]
    total = sum(e - s for s, e, _ in comm)
    hidden = sum(covered(compute, starts, s, e) for s, e, _ in comm)
    steps = sum(1 for e in events if e.get("name") == "run_training_batch")
    return {"hidden": hidden / total if total else float("nan"), "comm_ms": total / 1000 / max(steps, 1),
            "backward_ms": sum(e["dur"] for e in backward) / 1000 / max(steps, 1), "steps": steps,
            "collectives": len(comm)}


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(json.dumps({"trace": p, **analyse(p)}))
