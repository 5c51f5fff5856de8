"""The same models under PyTorch Lightning (pinned in scripts/requirements.txt): the Python
counterpart of bench_compare --side fulgur / fulgur-bare.

    python lightning_bench.py --side lightning --model mlp --batch 64 --steps 300 --root /tmp/x
    python lightning_bench.py --side lightning-bare ...   # Trainer(barebones=True)

The default run is what a user gets from Trainer(): CSVLogger, model summary, ModelCheckpoint at
epoch end, the progress bar only on a terminal (as the Fulgur run).
"""

import time

_spawn_fallback = time.monotonic_ns()  # when run by hand without --spawn-ns

import sys  # noqa: E402
import warnings  # noqa: E402

import lightning as L  # noqa: E402  (importing Lightning is part of the time to first step)
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import models  # noqa: E402


class LitModel(L.LightningModule):
    def __init__(self, name, net):
        super().__init__()
        self.name = name
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = models.loss_fn(self.name, self.net, x, y)
        # Fulgur's models log their loss the same way; Lightning refuses self.log in barebones mode.
        if not self.trainer.barebones:
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return models.make_optimizer(self.parameters())


class PoolBatches(torch.utils.data.Dataset):
    """Item i is batch i of the epoch (already batched: DataLoader(batch_size=None) adds no collate)."""

    def __init__(self, pool, steps):
        self.pool = pool
        self.steps = steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        return self.pool.at(i)


class MeterCallback(L.Callback):
    def __init__(self, meter):
        self.meter = meter
        self.last_loss = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter.step_start(batch_idx, self.last_loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last_loss = outputs["loss"]
        self.meter.step_end(batch_idx, self.last_loss)


def main():
    args = models.parse_args("Lightning", ["lightning", "lightning-bare"])
    meter = models.Meter(args.steps, args.warmup, args.spawn_ns or _spawn_fallback)
    pool, net, pool_sum, init_sum = models.setup(args)
    barebones = args.side == "lightning-bare"
    # Advice about DataLoader workers and the like; it goes to stderr, which nobody reads here.
    warnings.filterwarnings("ignore")
    common = dict(
        accelerator="cuda" if args.device.startswith("cuda") else "cpu",
        devices=1,
        precision="64-true" if args.dtype == "float64" else "32-true",
        max_epochs=1,
        default_root_dir=args.root or None,
        callbacks=[MeterCallback(meter)],
    )
    if barebones:
        trainer = L.Trainer(barebones=True, **common)
    else:
        trainer = L.Trainer(
            logger=CSVLogger(args.root or "."),
            log_every_n_steps=50,
            enable_progress_bar=sys.stdout.isatty(),
            enable_checkpointing=True,
            enable_model_summary=True,
            **common,
        )
    loader = torch.utils.data.DataLoader(PoolBatches(pool, args.steps), batch_size=None, shuffle=False)
    trainer.fit(LitModel(args.model, net), loader)
    if trainer.global_step != meter.count:
        meter.count = -1  # batches and optimizer steps disagree
    meter.report(args.side, args, pool_sum, init_sum)


if __name__ == "__main__":
    main()
