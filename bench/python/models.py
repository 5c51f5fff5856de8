"""The Python half of bench/compare.sh: the three models, their data and initial weights, and the
per-process measurement, mirroring bench/compare.cpp exactly.

Data and weights come from seeded torch generators of the same libtorch the C++ side links, with
parameters initialised by sorted name, so C++ and Python start from bit-identical tensors and the
first loss matches bit for bit (the harness checks it).
"""

import argparse
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# Shared with bench/compare.cpp: change both or the same-work check fails.
DATA_SEED = 1234
WEIGHT_SEED = 4321
DROPOUT_SEED = 42
LR = 1e-3
GPT_VOCAB = 256
GPT_SEQ = 64
GPT_DIM = 128
GPT_HEADS = 4
GPT_LAYERS = 2


class Mlp(nn.Module):
    """784 -> 256 -> 10, as FashionMnistMlp in examples/fashion_mnist."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Cnn(nn.Module):
    """FashionMnistCnn in examples/fashion_mnist, op for op (dropout applied twice)."""

    def __init__(self, dropout=0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.dropout = nn.Dropout(dropout)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = self.dropout(x.flatten(1))
        x = self.dropout(torch.relu(self.fc1(x)))
        return self.fc2(x)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    """Token + positional embedding, pre-LN causal blocks, final LayerNorm, LM head (Gpt in compare.cpp)."""

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(GPT_VOCAB, GPT_DIM)
        self.pos_emb = nn.Embedding(GPT_SEQ, GPT_DIM)
        self.blocks = nn.ModuleList([Block(GPT_DIM, GPT_HEADS) for _ in range(GPT_LAYERS)])
        self.ln_f = nn.LayerNorm(GPT_DIM)
        self.head = nn.Linear(GPT_DIM, GPT_VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.size(1), dtype=tokens.dtype, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(name):
    model = {"mlp": Mlp, "cnn": Cnn, "gpt": Gpt}[name]()
    init_weights(model)
    return model


def loss_fn(name, model, x, y):
    if name == "gpt":
        return F.cross_entropy(model(x).view(-1, GPT_VOCAB), y.view(-1))
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def init_weights(model):
    """By sorted name, one seeded generator each: matrices randn / sqrt(fan_in), 1-D weights one, biases zero."""
    for k, (name, p) in enumerate(sorted(model.named_parameters())):
        gen = torch.Generator().manual_seed(WEIGHT_SEED + k)
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.numel() // p.size(0)))
        elif name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def weight_checksum(model):
    return sum(p.detach().to("cpu", torch.float64).abs().sum().item() for p in model.parameters())


class Pool:
    """`batches` distinct batches, served cyclically (small memory at any number of steps)."""

    def __init__(self, model, batch, batches):
        n = batch * batches
        gen = torch.Generator().manual_seed(DATA_SEED)
        if model == "gpt":
            start = torch.randint(0, GPT_VOCAB, (n, 1), generator=gen, dtype=torch.int64)
            stride = torch.randint(1, 8, (n, 1), generator=gen, dtype=torch.int64)
            tokens = (start + torch.arange(GPT_SEQ + 1, dtype=torch.int64) * stride).remainder(GPT_VOCAB)
            self.x = tokens[:, :GPT_SEQ].contiguous()
            self.y = tokens[:, 1:].contiguous()
        else:
            self.x = torch.randn((n, 1, 28, 28), generator=gen)
            self.y = self.x.view(n, -1)[:, :10].argmax(1)
        self.batch = batch
        self.batches = batches

    def at(self, step):
        j = step % self.batches
        return self.x.narrow(0, j * self.batch, self.batch), self.y.narrow(0, j * self.batch, self.batch)

    def checksum(self):
        return self.x.to(torch.float64).abs().sum().item() + self.y.to(torch.float64).sum().item()


class Meter:
    """Per-step timestamps, the synchronised timed window and the losses; Meter in compare.cpp."""

    def __init__(self, steps, warmup, spawn_ns):
        self.starts = [0] * steps
        self.warmup = warmup
        self.spawn_ns = spawn_ns
        self.count = 0
        self.first_loss = self.final_loss = math.nan

    def step_start(self, i, previous_loss):
        if i == 0:
            self.first_step_ns = time.monotonic_ns()
            torch.manual_seed(DROPOUT_SEED)
        if i == self.warmup:
            if previous_loss is not None:
                previous_loss.item()  # waits for the device: the window holds whole steps
            self.cpu_start = time.process_time()
            self.timed_start_ns = time.monotonic_ns()
        self.starts[i] = time.monotonic_ns()

    def step_end(self, i, loss):
        self.count += 1
        if i == 0:
            self.first_loss = loss.item()
        if i + 1 == len(self.starts):
            self.final_loss = loss.item()
            self.end_ns = time.monotonic_ns()
            self.cpu_end = time.process_time()

    def report(self, side, args, pool_sum, init_sum):
        timed = len(self.starts) - self.warmup
        ends = self.starts[self.warmup + 1 :] + [self.end_ns]
        us = sorted((e - s) / 1e3 for s, e in zip(self.starts[self.warmup :], ends))
        result = {
            "side": side,
            "model": args.model,
            "batch": args.batch,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "steps": self.count,
            "first_loss": self.first_loss,
            "final_loss": self.final_loss,
            "steps_per_s": timed / ((self.end_ns - self.timed_start_ns) / 1e9),
            "median_step_us": us[len(us) // 2],
            "cpu_us_per_step": (self.cpu_end - self.cpu_start) * 1e6 / timed,
            "first_step_ms": (self.first_step_ns - self.spawn_ns) / 1e6,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "data_sum": pool_sum,
            "init_sum": init_sum,
        }
        print("BENCH_RESULT " + json.dumps(result), flush=True)


def parse_args(description, sides):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--side", choices=sides, default=sides[0])
    p.add_argument("--model", choices=["mlp", "cnn", "gpt"], required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pool", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--root", default="")
    p.add_argument("--spawn-ns", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="float64: the same-work verification run (compare.py)")
    args = p.parse_args()
    if not 1 <= args.warmup < args.steps:
        sys.exit("need 1 <= --warmup < --steps")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def setup(args):
    """Pool, model (initialised, on the device) and the two checksums, as compare.cpp's run()."""
    pool = Pool(args.model, args.batch, min(args.pool, args.steps))
    model = make_model(args.model)
    pool_sum, init_sum = pool.checksum(), weight_checksum(model)
    if args.dtype == "float64":
        # Generated and initialised in float32 as always, then widened: the same values as float32.
        pool.x = pool.x.double() if pool.x.is_floating_point() else pool.x
        model = model.double()
    return pool, model.to(args.device), pool_sum, init_sum


def make_optimizer(params):
    # C++ torch::optim::Adam has no foreach/fused path; Python's default turns foreach on for CUDA
    # tensors. Off, both languages run the same per-parameter kernels (on the CPU it is off anyway).
    return torch.optim.Adam(params, lr=LR, foreach=False)
