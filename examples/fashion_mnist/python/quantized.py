"""Serve the int8 / int4 weight-only files `fulgur quantize` writes, with torchao's weight-only math.

    # Check that this reproduces `fulgur predict --ckpt_path=int8.safetensors` (exit 1 if not):
    python quantized.py --model fashion_mnist_mlp --weights int8.safetensors \\
        --predictions predictions.pt --data /usr/share/datasets/fashion-mnist

torchao is not a dependency of Fulgur (scripts/requirements.txt does not pin it, and the venv
does not have it), so this file is the reference loader: it reads Fulgur's unpacked tensors, names
them as the fields of torchao's affine-quantized weight (`torchao_fields`), and computes each
quantized layer as torchao's CPU weight-only kernels do:

    Int8WeightOnlyConfig (per output channel, symmetric, zero point 0):
        y = (x @ int_data.T) * scale + bias
    Int4WeightOnlyConfig (tinygemm convention, zero_point_domain FLOAT, block_size (1, group)):
        w = (int_data - 8) * scale + zero   per group of `group` inputs;   y = x @ w.T + bias

Fulgur's file keeps, per quantized layer `L` (metadata "fulgur.quantization", "fulgur.group_size",
"fulgur.quantized_layers"):
    L.weight        int8 [out, in] (int8) | uint8 0..15 [out, in] (int4)   -> int_data
    L.weight_scale  float32 [out] (int8)  | [out, in / group] (int4)       -> scale
    L.weight_zero   float32 [out, in / group] (int4 only)                  -> zero_point
The other tensors (biases, unquantized layers) are the float model's, with their usual names.
"""

import argparse
import json
import sys

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from fashion_mnist_nets import make_net, read_test_images


class WeightOnlyLinear(nn.Module):
    """An nn.Linear whose weight is int8 per channel or int4 per group, computed as torchao does."""

    def __init__(self, method: str, int_data: torch.Tensor, scale: torch.Tensor, zero, group_size: int, bias):
        super().__init__()
        self.method, self.group_size = method, group_size
        self.register_buffer("int_data", int_data)
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        if self.method == "int8":
            return self.int_data.float() * self.scale[:, None]
        out, inputs = self.int_data.shape
        groups = self.scale.shape[1]
        # A last group cut short by in_features: padded with code 8, which stands for the zero.
        codes = F.pad(self.int_data.float(), (0, groups * self.group_size - inputs), value=8.0)
        w = (codes.reshape(out, groups, self.group_size) - 8.0) * self.scale[..., None] + self.zero_point[..., None]
        return w.reshape(out, -1)[:, :inputs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            # torchao's _linear_fp_act_int8_weight_impl: the integer weight in the input's type,
            # one matmul, then the per-channel scale.
            flat = x.reshape(-1, x.shape[-1])
            y = torch.mm(flat, self.int_data.t().to(x.dtype)) * self.scale.to(x.dtype)
            y = y.reshape(*x.shape[:-1], -1)
        else:
            y = x @ self.dequantized().to(x.dtype).t()
        return y if self.bias is None else y + self.bias


def read_quantized(path: str):
    """The file's tensors and its quantization: (tensors, method, group_size, quantized layer names)."""
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    method = metadata.get("fulgur.quantization")
    if method not in ("int8", "int4"):
        raise SystemExit(f"{path}: not written by `fulgur quantize` (no fulgur.quantization = int8 | int4)")
    if metadata.get("fulgur.activations", "none") != "none":
        # torchao's Int8DynamicActivation* configs, not the weight-only ones this loader reproduces.
        raise SystemExit(f"{path}: its layers quantize their inputs to int8 ({metadata['fulgur.activations']}); "
                         "this loader serves weight-only files (`fulgur quantize` without --activations)")
    layers = [name for name in metadata.get("fulgur.quantized_layers", "").split(",") if name]
    return tensors, method, int(metadata.get("fulgur.group_size", "0")), layers


def torchao_fields(path: str) -> dict:
    """Per quantized layer, the fields of torchao's affine-quantized weight, from Fulgur's tensors."""
    tensors, method, group_size, layers = read_quantized(path)
    fields = {}
    for layer in layers:
        weight = tensors[f"{layer}.weight"]
        scale = tensors[f"{layer}.weight_scale"]
        if method == "int8":
            fields[layer] = dict(int_data=weight, scale=scale, zero_point=torch.zeros_like(scale, dtype=torch.int64),
                                 block_size=(1, weight.shape[1]), quant_min=-128, quant_max=127,
                                 zero_point_domain="INT", layout="PlainLayout")
        else:
            fields[layer] = dict(int_data=weight, scale=scale, zero_point=tensors[f"{layer}.weight_zero"],
                                 block_size=(1, group_size), quant_min=0, quant_max=15,
                                 zero_point_domain="FLOAT", layout="TensorCoreTiledLayout / Int4CPULayout")
    return fields


def load_quantized(model: str, path: str) -> nn.Module:
    """The example net with the file's weights, its quantized layers replaced by WeightOnlyLinear."""
    tensors, method, group_size, layers = read_quantized(path)
    net = make_net(model)
    rest = dict(tensors)
    for layer in layers:
        parent_name, _, child = layer.rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        if not isinstance(getattr(parent, child, None), nn.Linear):
            raise SystemExit(f"{path}: quantized layer '{layer}' is not an nn.Linear of {model}")
        replacement = WeightOnlyLinear(method, rest.pop(f"{layer}.weight"), rest.pop(f"{layer}.weight_scale"),
                                       rest.pop(f"{layer}.weight_zero", None), group_size,
                                       rest.pop(f"{layer}.bias", None))
        setattr(parent, child, replacement)
    # Everything else loads strictly into the float layers that remain.
    missing, unexpected = net.load_state_dict(rest, strict=False)
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in layers]
    if missing or unexpected:
        raise SystemExit(f"{path}: missing {missing}, unexpected {unexpected}")
    return net.eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="fashion_mnist_cnn or fashion_mnist_mlp")
    parser.add_argument("--weights", required=True, help="safetensors file from `fulgur quantize`")
    parser.add_argument("--predictions", help="predictions.pt from `fulgur predict --ckpt_path=<the file>`")
    parser.add_argument("--data", help="the Fashion-MNIST directory (t10k-images-idx3-ubyte.gz)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest absolute difference accepted")
    parser.add_argument("--fields", action="store_true", help="print torchao's fields per layer as JSON")
    args = parser.parse_args()
    if args.fields:
        described = {layer: {k: (list(v.shape) if torch.is_tensor(v) else v) for k, v in f.items()}
                     for layer, f in torchao_fields(args.weights).items()}
        print(json.dumps(described, sort_keys=True))
    if not args.predictions:
        return 0
    net = load_quantized(args.model, args.weights)
    expected = torch.cat(torch.load(args.predictions, weights_only=True))
    with torch.inference_mode():
        served = net(read_test_images(args.data, expected.shape[0]))
    diff = (served - expected).abs().max().item()
    print(f"{expected.shape[0]} images, {args.model}, {args.weights}")
    print(f"torchao weight-only math vs fulgur predict: max |diff| = {diff:.3g}")
    if diff > args.tolerance:
        print(f"FAILED: above the tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
