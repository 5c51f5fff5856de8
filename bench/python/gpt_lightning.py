"""The GPT example (examples/gpt) written in Python for Lightning, for bench/distributed.sh.

The same model (pre-LN blocks, causal SDPA, tanh GELU, tied embedding head), the same initial
weights (loaded from the .safetensors Fulgur's bench_step_probe wrote), the same data (Fulgur's
token file read as uint16, every offset a window; each epoch's order torch.randperm on a CPU
generator seeded seed + epoch, padded and dealt rank::world_size exactly as Fulgur's
distributed_sampler; batches of batch_size, the last one dropped), the same optimizer (AdamW, decay
on Linear weights only, constant learning rate) and no clipping, no validation, no logger, no
checkpoint. After every training batch every rank prints the line bench_step_probe prints:
  FULGUR_STEP rank=R step=I t=SECONDS loss=L wchar=BYTES rss_kib=KIB minflt=N cpu=SECONDS

  python gpt_lightning.py --strategy ddp|fsdp_full|fsdp_grad_op|single --tokens train.bin --init init.safetensors
"""

import argparse
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.tok_emb = nn.Embedding(256, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # tied head, as examples/gpt


class Windows(torch.utils.data.Dataset):
    """Fulgur's data::TokenFile at stride 1: window i is tokens[i : i + block + 1]."""

    def __init__(self, path, block):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self):
        return len(self.tokens) - (self.block + 1) + 1

    def __getitem__(self, i):
        w = torch.from_numpy(self.tokens[i : i + self.block + 1].astype(np.int64))
        return w[:-1], w[1:]


class FulgurOrder(torch.utils.data.Sampler):
    """data/src/sampler.cpp: Random (randperm, generator seed + epoch) inside Distributed (drop tail)."""

    def __init__(self, n, seed, rank, world):
        self.n, self.seed, self.rank, self.world, self.epoch = n, seed, rank, world, 0

    def __len__(self):
        return self.n // self.world

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        total = len(self) * self.world
        self.epoch += 1
        return iter(perm[self.rank : total : self.world])


def load_init(model, path):
    from safetensors.torch import load_file

    state = load_file(path)
    # Fulgur's GPT keeps attention's projections as attn.q / attn.k / attn.v (the rows of one fused
    # qkv, so that checkpoints move across tensor-parallel degrees); this model keeps the fused qkv.
    for name in [n for n in state if n.endswith(".attn.q.weight") or n.endswith(".attn.q.bias")]:
        stem, kind = name[: -len(".q." + name.rsplit(".", 1)[1])], name.rsplit(".", 1)[1]
        parts = [state.pop(f"{stem}.{p}.{kind}") for p in "qkv"]
        state[f"{stem}.qkv.{kind}"] = torch.cat(parts, 0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        sys.exit(f"gpt_lightning: {path}: missing {missing}, unexpected {unexpected}")


def proc_wchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return -1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp_full", "fsdp_grad_op", "single"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokens", required=True, help="Fulgur's train.bin (uint16 byte tokens)")
    p.add_argument("--init", required=True, help="initial weights (.safetensors) from bench_step_probe")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--trace", help="also record 4 steps after --trace-wait with torch.profiler: one Chrome trace "
                                   "per rank in this directory, with 'backward' and 'run_training_batch' scopes "
                                   "as Fulgur's (overlap.py reads both)")
    p.add_argument("--trace-wait", type=int, default=5)
    args = p.parse_args()

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    class Probe(L.Callback):
        def __init__(self):
            self.step = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            ru = resource.getrusage(resource.RUSAGE_SELF)
            sys.stderr.write(
                f"FULGUR_STEP rank={trainer.global_rank} step={self.step} t={time.monotonic():.6f} "
                f"loss={float(loss):.8f} wchar={proc_wchar()} rss_kib={ru.ru_maxrss} minflt={ru.ru_minflt} "
                f"cpu={ru.ru_utime + ru.ru_stime:.6f}\n")
            sys.stderr.flush()
            self.step += 1

    class Trace(L.Callback):
        """torch.profiler over steps trace_wait+1 .. trace_wait+4 (after a warm-up step), with the scopes
        Fulgur's profiler plugin records: 'run_training_batch' around each batch, 'backward' around
        backward. Gloo's worker threads record their collectives as gloo:<op> intervals."""

        def __init__(self, directory, wait):
            self.directory, self.first, self.last = directory, wait + 1, wait + 4
            self.step, self.prof, self.batch_scope, self.backward_scope = 0, None, None, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.step == self.first:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()
            if self.prof is not None:
                self.batch_scope = torch.autograd.profiler.record_function("run_training_batch")
                self.batch_scope.__enter__()

        def on_before_backward(self, trainer, pl_module, loss):
            if self.prof is not None:
                self.backward_scope = torch.autograd.profiler.record_function("backward")
                self.backward_scope.__enter__()

        def on_after_backward(self, trainer, pl_module):
            if self.backward_scope is not None:
                self.backward_scope.__exit__(None, None, None)
                self.backward_scope = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.batch_scope is not None:
                self.batch_scope.__exit__(None, None, None)
                self.batch_scope = None
            if self.prof is not None and self.step == self.last:
                self.prof.__exit__(None, None, None)
                os.makedirs(self.directory, exist_ok=True)
                self.prof.export_chrome_trace(
                    os.path.join(self.directory, f"rank{trainer.global_rank}.pt.trace.json"))
                self.prof = None
            self.step += 1

    class GptModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Gpt(args.block_size, args.n_layer, args.n_head, args.n_embd)
            load_init(self.model, args.init)

        def configure_model(self):
            if not args.strategy.startswith("fsdp"):
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            reshard = args.strategy == "fsdp_full"
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

        def configure_optimizers(self):
            decay = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
            params = list(self.parameters())
            groups = [{"params": [q for q in params if id(q) in decay], "weight_decay": args.weight_decay},
                      {"params": [q for q in params if id(q) not in decay], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), eps=1e-8)

        def train_dataloader(self):
            ds = Windows(args.tokens, args.block_size)
            world = self.trainer.world_size
            sampler = FulgurOrder(len(ds), args.seed, self.trainer.global_rank, world)
            return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                                               num_workers=0)

    if args.strategy == "ddp":
        strategy, devices = DDPStrategy(process_group_backend="gloo"), args.devices
    elif args.strategy.startswith("fsdp"):
        # Lightning's FSDPStrategy (FSDP1) refuses accelerator="cpu", and torch's FSDP1 needs an
        # accelerator device. ModelParallelStrategy is Lightning's FSDP2 (fully_shard), which runs on
        # CPU over Gloo: each Block a unit, then the root, as Lightning's docs show. FULL_SHARD is
        # reshard_after_forward=True, SHARD_GRAD_OP reshard_after_forward=False.
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
        devices = args.devices
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true",
                        max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, use_distributed_sampler=False,
                        callbacks=[Probe()] + ([Trace(args.trace, args.trace_wait)] if args.trace else []))
    trainer.fit(GptModule())


if __name__ == "__main__":
    main()
