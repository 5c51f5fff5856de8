"""A plain PyTorch training loop: the Python counterpart of bench_compare --side raw.

    python plain_loop.py --model mlp --batch 64 --steps 300
"""

import time

_spawn_fallback = time.monotonic_ns()  # when run by hand without --spawn-ns

import torch  # noqa: E402  (after the clock: importing torch is part of the time to first step)

import models  # noqa: E402


def main():
    args = models.parse_args("plain PyTorch loop", ["plain"])
    meter = models.Meter(args.steps, args.warmup, args.spawn_ns or _spawn_fallback)
    pool, model, pool_sum, init_sum = models.setup(args)
    model.train()
    optimizer = models.make_optimizer(model.parameters())
    loss = None
    for i in range(args.steps):
        meter.step_start(i, loss)
        x, y = pool.at(i)
        loss = models.loss_fn(args.model, model, x.to(args.device), y.to(args.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter.step_end(i, loss)
    meter.report("plain", args, pool_sum, init_sum)


if __name__ == "__main__":
    main()
