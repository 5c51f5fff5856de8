"""examples/fashion_mnist written for PyTorch Lightning: the Python side of bench/real.sh.

Same data (the Debian dataset-fashion-mnist IDX files, same normalisation, same seeded 5000-image
validation hold-out), same models (FashionMnistCnn / FashionMnistMlp in examples/fashion_mnist),
Adam lr 1e-3, batch 64, and the plugins examples/fashion_mnist/fashion_mnist.toml selects: CSV
logger, checkpoint on val/acc (max, save_last), early stopping on val/loss (patience 3), progress
bar, model summary, simple profiler. The data path is what a Lightning user writes: a
TensorDataset and a DataLoader with shuffle=True, num_workers=0 (the example's num_workers).

    python real_lightning.py --arch cnn --epochs 1 --root /tmp/x

Prints "epoch N: S s" per training epoch (train + end-of-epoch validation, as the C++ example's
EpochTimer) and a final REAL_RESULT JSON line.
"""

import argparse
import gzip
import json
import os
import struct
import sys
import time
import warnings

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from models import Cnn  # the example's CNN, op for op (bench/python/models.py)

MEAN, STD = 0.2860, 0.3530  # kFashionMnistMean / kFashionMnistStd in examples/fashion_mnist


def read_idx(path, dims):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack(">I", data[:4])[0]
    if magic != 0x800 + dims:
        sys.exit(f"{path}: bad IDX magic 0x{magic:08x}")
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8).reshape(shape)


def load(directory, train):
    prefix = "train" if train else "t10k"

    def path(name):
        p = os.path.join(directory, f"{prefix}-{name}-idx{3 if name == 'images' else 1}-ubyte")
        return p + ".gz" if os.path.exists(p + ".gz") else p

    images = read_idx(path("images"), 3).to(torch.float32).div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    labels = read_idx(path("labels"), 1).to(torch.int64)
    return images, labels


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Classifier(L.LightningModule):
    def __init__(self, arch, lr=1e-3, dropout=0.25):
        super().__init__()
        self.save_hyperparameters()
        self.net = Cnn(dropout) if arch == "cnn" else Mlp()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch, prefix, prog_bar):
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}/loss", F.cross_entropy(logits, y), prog_bar=prog_bar)
        self.log(f"{prefix}/acc", (logits.argmax(1) == y).float().mean(), prog_bar=prog_bar)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val", True)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test", False)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Data(L.LightningDataModule):
    def __init__(self, directory, batch_size, val_split, seed):
        super().__init__()
        self.directory, self.batch_size, self.val_split, self.seed = directory, batch_size, val_split, seed

    def setup(self, stage):
        if stage in ("fit", "validate") and not hasattr(self, "train"):
            images, labels = load(self.directory, True)
            # The example's hold-out: a seeded permutation, each part sorted back into file order.
            perm = torch.randperm(images.size(0), generator=torch.Generator().manual_seed(self.seed))
            val_idx, train_idx = perm[: self.val_split].sort().values, perm[self.val_split :].sort().values
            self.train = torch.utils.data.TensorDataset(images[train_idx], labels[train_idx])
            self.val = torch.utils.data.TensorDataset(images[val_idx], labels[val_idx])
        if stage == "test":
            self.test = torch.utils.data.TensorDataset(*load(self.directory, False))

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(self.seed)
        return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=gen)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self):
        return torch.utils.data.DataLoader(self.test, batch_size=self.batch_size)


class EpochTimer(L.Callback):
    """Train + end-of-epoch validation (Lightning validates before on_train_epoch_end)."""

    def __init__(self):
        self.seconds = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.start = time.monotonic()

    def on_train_epoch_end(self, trainer, pl_module):
        self.seconds.append(time.monotonic() - self.start)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--limit-train-batches", type=int, default=0, help="0: the whole epoch (smoke tests use a few)")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--root", default="runs/fashion_mnist_lightning")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # advice about DataLoader workers and the like
    L.seed_everything(42, verbose=False)  # [trainer] seed = 42

    timer = EpochTimer()
    limit = {"limit_train_batches": args.limit_train_batches, "limit_val_batches": args.limit_train_batches,
             "limit_test_batches": args.limit_train_batches} if args.limit_train_batches else {}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_epochs=args.epochs,
        default_root_dir=args.root,
        log_every_n_steps=50,
        logger=CSVLogger(args.root),
        profiler="simple",
        callbacks=[
            ModelCheckpoint(monitor="val/acc", mode="max", save_last=True, filename="{epoch}-{val/acc:.4f}"),
            EarlyStopping(monitor="val/loss", patience=3),
            TQDMProgressBar(),
            ModelSummary(),
            timer,
        ],
        **limit,
    )
    model = Classifier(args.arch)
    data = Data(args.data, 64, 5000, 42)
    fit_start = time.monotonic()
    trainer.fit(model, data)
    fit_seconds = time.monotonic() - fit_start
    results = trainer.test(model, data, verbose=False)
    for i, s in enumerate(timer.seconds):
        print(f"epoch {i}: {s:.1f} s (train + validation)")
    print("REAL_RESULT " + json.dumps({
        "epoch_s": timer.seconds,
        "fit_s": fit_seconds,
        "steps": trainer.global_step,
        "test_acc": results[0].get("test/acc") if results else None,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }), flush=True)


if __name__ == "__main__":
    main()
