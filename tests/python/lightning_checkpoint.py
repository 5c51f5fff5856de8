"""The Python side of tests/lightning_checkpoint_test.cpp: PyTorch Lightning 2.6 (the venv's) using a
checkpoint that `fulgur fit` wrote for the Fashion-MNIST MLP (model fashion_mnist_mlp: fc1 784->256,
fc2 256->10, Adam). Prints "python-ok" on success; an assertion names what differed.

  resume CKPT MAX_EPOCHS EPOCH STEP FINAL_STEP
      Trainer(max_epochs=MAX_EPOCHS).fit(model, ckpt_path=CKPT) with 4 batches per epoch: when
      training starts the trainer is at epoch EPOCH and global step STEP with the checkpoint's
      weights and Adam state; when it ends at epoch MAX_EPOCHS and step FINAL_STEP.
  load CKPT
      FashionMnistMlp.load_from_checkpoint(CKPT): the weights and hyper_parameters Fulgur wrote.
"""

import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

warnings.filterwarnings("ignore")  # no workers, no validation loader, a non-resumable loader


class FashionMnistMlp(pl.LightningModule):
    """examples/fashion_mnist/fashion_mnist_nets.h's FashionMnistMlp, parameter for parameter."""

    def __init__(self, optimizer="adam", lr=1e-3, weight_decay=0.0, momentum=0.9, max_iter=20):
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 10)
        self.at_start = None

    def forward(self, images):
        return self.fc2(torch.relu(self.fc1(images.flatten(1))))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        assert self.hparams.optimizer == "adam"
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def on_train_start(self):
        # After Lightning restored the checkpoint, before the first batch.
        optimizer = self.optimizers().optimizer
        self.at_start = {
            "epoch": self.trainer.current_epoch,
            "step": self.trainer.global_step,
            "fc1.weight": self.fc1.weight.detach().clone(),
            "adam": {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in self.named_parameters()},
            "lr": optimizer.param_groups[0]["lr"],
        }


def loader():
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4 * 32, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (4 * 32,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=32)


def resume(path, max_epochs, epoch, step, final_step):
    saved = torch.load(path, weights_only=True)
    model = FashionMnistMlp()
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=".")
    trainer.fit(model, train_dataloaders=loader(), ckpt_path=path)

    start = model.at_start
    assert start is not None, "training did not start"
    assert (start["epoch"], start["step"]) == (epoch, step), f"resumed at (epoch, step) {start['epoch'], start['step']}"
    assert torch.equal(start["fc1.weight"], saved["state_dict"]["fc1.weight"]), "fc1.weight is not the checkpoint's"
    # Adam's state is the checkpoint's: torch.optim.Adam.load_state_dict accepted Fulgur's layout.
    saved_adam = saved["optimizer_states"][0]
    names = [name for name, _ in model.named_parameters()]
    for index, name in enumerate(names):
        state = start["adam"][name]
        assert int(state["step"]) == step, f"{name}: Adam step {int(state['step'])}, expected {step}"
        assert torch.equal(state["exp_avg"], saved_adam["state"][index]["exp_avg"]), f"{name}: exp_avg differs"
        assert torch.equal(state["exp_avg_sq"], saved_adam["state"][index]["exp_avg_sq"]), f"{name}: exp_avg_sq"
    assert start["lr"] == saved["hyper_parameters"]["lr"], start["lr"]

    assert trainer.current_epoch == max_epochs, f"ended at epoch {trainer.current_epoch}"
    assert trainer.global_step == final_step, f"ended at global step {trainer.global_step}"
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == final_step, trainer.fit_loop.epoch_loop._batches_that_stepped
    adam = trainer.optimizers[0].state[model.fc1.weight]
    assert int(adam["step"]) == final_step, f"Adam step {int(adam['step'])} at the end"
    print(f"resumed at epoch {epoch} step {step}, ended at epoch {trainer.current_epoch} step {trainer.global_step}")


def load(path):
    saved = torch.load(path, weights_only=True)
    model = FashionMnistMlp.load_from_checkpoint(path, map_location="cpu")
    assert dict(model.hparams) == saved["hyper_parameters"], f"{dict(model.hparams)} vs {saved['hyper_parameters']}"
    state = model.state_dict()
    assert sorted(state) == sorted(saved["state_dict"]), f"{sorted(state)} vs {sorted(saved['state_dict'])}"
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(state[name], tensor), f"{name} differs"
    print("hparams", dict(model.hparams))


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "resume":
        resume(path, *map(int, sys.argv[3:7]))
    elif mode == "load":
        load(path)
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("python-ok")
