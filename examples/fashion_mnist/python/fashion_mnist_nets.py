"""The Fashion-MNIST example's two nets as PyTorch modules, for serving Fulgur-trained weights.

They mirror examples/fashion_mnist/fashion_mnist_nets.h layer for layer, with the same parameter
names, so the safetensors file that `fulgur weights convert run.ckpt model.safetensors` writes
loads into them with `strict=True`. Keep the two in step: the deployment test
(tests/deployment_test.cpp) compares their outputs with `fulgur predict`'s.
"""

import gzip
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

#: The pixel statistics the example's datamodule normalizes with (fashion_mnist.h).
MEAN = 0.2860
STD = 0.3530
CLASSES = 10


class FashionMnistCnn(nn.Module):
    """conv(1->32) -> pool -> conv(32->64) -> pool -> dropout -> fc(3136->128) -> fc(128->10)."""

    def __init__(self, dropout: float = 0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.dropout = nn.Dropout(dropout)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(x.flatten(1))
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)


class FashionMnistMlp(nn.Module):
    """784 -> 256 -> 10."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(images.flatten(1))))


#: The `[model] name` of each Fulgur model plugin and the class that matches it.
ARCHITECTURES = {"fashion_mnist_cnn": FashionMnistCnn, "fashion_mnist_mlp": FashionMnistMlp}


def make_net(name: str) -> nn.Module:
    """The net for a Fulgur model plugin name ("fashion_mnist_cnn" or "fashion_mnist_mlp")."""
    try:
        return ARCHITECTURES[name]()
    except KeyError:
        raise SystemExit(f"unknown model '{name}': use one of {', '.join(ARCHITECTURES)}") from None


def read_test_images(data_dir: str, count: int) -> torch.Tensor:
    """The first `count` test images, normalized as the datamodule does: float32 [count, 1, 28, 28]."""
    path = Path(data_dir) / "t10k-images-idx3-ubyte.gz"
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, n, rows, cols = (int.from_bytes(raw[i : i + 4], "big") for i in range(0, 16, 4))
    if magic != 2051 or rows != 28 or cols != 28:
        raise SystemExit(f"{path}: not an idx3 file of 28x28 images")
    pixels = np.frombuffer(raw, dtype=np.uint8, offset=16, count=min(count, n) * rows * cols)
    images = torch.from_numpy(pixels.copy()).reshape(-1, 1, rows, cols)
    # The C++ datamodule computes -mean / std + x * (1 / (255 std)) as one add of the uint8 pixels
    # to a float32 scalar tensor; the same op gives the same bits.
    return torch.add(torch.scalar_tensor(-MEAN / STD, dtype=torch.float32), images, alpha=1.0 / (255.0 * STD))
