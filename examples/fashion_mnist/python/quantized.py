"""Serve the int8 / int4 weight-only files `fulgur quantize` writes, with torchao's weight-only math.

    # Check that this reproduces `fulgur predict --ckpt_path=int8.safetensors` (exit 1 if not):
    python quantized.py --model fashion_mnist_mlp --weights int8.safetensors \\
        --predictions predictions.pt --data /usr/share/datasets/fashion-mnist

By default it builds the example net, calls torchao's own `quantize_` on each quantized layer with
the matching config, and loads Fulgur's tensors into the fields of the quantized weight torchao
made; the forward is then torchao's (torchao 0.18, pinned in scripts/requirements.txt):

    int8: Int8WeightOnlyConfig() -> Int8Tensor (per row, symmetric): qdata = weight,
          scale = weight_scale; torchao computes y = (x @ qdata.T) * scale + bias.
    int4: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(block))
          -> IntxUnpackedToInt8Tensor: qdata = weight - 8 (int8, -8..7), scale = weight_scale,
          zero_point = -weight_zero / weight_scale (a float zero point, which the tensor accepts);
          torchao computes w = (qdata - zero_point) * scale, i.e. (code - 8) * scale + zero.
          block = gcd(group, in_features): torchao wants whole blocks, and Fulgur's last group may
          be cut short (784 inputs in groups of 32), so each group's scale is repeated per block.

    Int4WeightOnlyConfig itself has no CPU path in torchao 0.18: its plain and preshuffled layouts
    need the CUDA-only mslk kernels, tile_packed_to_4d is tinygemm on CUDA (bfloat16 only), and
    plain_int32 refuses the CPU. IntxWeightOnlyConfig is torchao's CPU int4 weight-only workflow.

`--reference` computes the same layers with this file's own math (WeightOnlyLinear) instead.

Fulgur's file keeps, per quantized layer `L` (metadata "fulgur.quantization", "fulgur.group_size",
"fulgur.quantized_layers"):
    L.weight        int8 [out, in] (int8) | uint8 0..15 [out, in] (int4)   -> qdata
    L.weight_scale  float32 [out] (int8)  | [out, in / group] (int4)       -> scale
    L.weight_zero   float32 [out, in / group] (int4 only)                  -> zero_point
The other tensors (biases, unquantized layers) are the float model's, with their usual names.
"""

import argparse
import json
import math
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


def torchao_fields(model: str, path: str) -> dict:
    """Per quantized layer, torchao's weight tensor: its class, block size and fields (dtype, shape)."""
    described = {}
    for name, module in torchao_quantized(model, path).named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or type(weight) in (torch.Tensor, nn.Parameter):
            continue
        fields = {field: [str(getattr(weight, field).dtype), list(getattr(weight, field).shape)]
                  for field in ("qdata", "scale", "zero_point") if getattr(weight, field, None) is not None}
        described[name] = dict(tensor=type(weight).__name__, block_size=list(weight.block_size), **fields)
    return described


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


def torchao_quantized(model: str, path: str) -> nn.Module:
    """The example net quantized by torchao's quantize_, with Fulgur's tensors in torchao's weights."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    tensors, method, group_size, layers = read_quantized(path)
    net = make_net(model)
    floats, stored = dict(tensors), {}
    for layer in layers:
        q, scale, zero = (floats.pop(f"{layer}.weight"), floats.pop(f"{layer}.weight_scale"),
                          floats.pop(f"{layer}.weight_zero", None))
        stored[layer] = (q, scale, zero)
        # Any float weight of the right shape: quantize_ makes the layout, Fulgur's values replace it.
        floats[f"{layer}.weight"] = torch.zeros(q.shape)
    net.load_state_dict(floats, strict=True)
    for layer, (q, scale, zero) in stored.items():
        inputs = q.shape[1]
        if method == "int8":
            config, kind = Int8WeightOnlyConfig(), Int8Tensor
        else:
            block = math.gcd(group_size, inputs)
            config, kind = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(block)), \
                IntxUnpackedToInt8Tensor
        quantize_(net, config, filter_fn=lambda module, fqn, layer=layer: fqn == layer)
        weight = net.get_submodule(layer).weight
        if type(weight) is not kind:
            raise SystemExit(f"{path}: torchao made a {type(weight).__name__} for '{layer}', not a {kind.__name__}")
        if method == "int8":
            # Symmetric: the zero point torchao keeps for the weight is 0.
            fields = dict(qdata=q, scale=scale.reshape(weight.scale.shape),
                          zero_point=torch.zeros_like(weight.zero_point))
        else:
            per_group = group_size // block
            blocks = inputs // block
            expand = lambda t: t.repeat_interleave(per_group, dim=1)[:, :blocks].contiguous()
            fields = dict(qdata=(q.to(torch.int16) - 8).to(torch.int8), scale=expand(scale),
                          zero_point=expand(-zero / scale))
        for name, value in fields.items():
            old = getattr(weight, name)
            if value.shape != old.shape or (name != "zero_point" and value.dtype != old.dtype):
                raise SystemExit(f"{path}: '{layer}' {name} is {value.dtype} {list(value.shape)}, torchao's "
                                 f"{old.dtype} {list(old.shape)}")
            setattr(weight, name, value)
    return net.eval()


def _torchao_version() -> str:
    import torchao

    return torchao.__version__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="fashion_mnist_cnn or fashion_mnist_mlp")
    parser.add_argument("--weights", required=True, help="safetensors file from `fulgur quantize`")
    parser.add_argument("--predictions", help="predictions.pt from `fulgur predict --ckpt_path=<the file>`")
    parser.add_argument("--data", help="the Fashion-MNIST directory (t10k-images-idx3-ubyte.gz)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest absolute difference accepted")
    parser.add_argument("--fields", action="store_true", help="print torchao's fields per layer as JSON")
    parser.add_argument("--reference", action="store_true",
                        help="compute the layers with this file's own math instead of torchao's")
    args = parser.parse_args()
    if args.fields:
        print(json.dumps(torchao_fields(args.model, args.weights), sort_keys=True))
    if not args.predictions:
        return 0
    net = (load_quantized if args.reference else torchao_quantized)(args.model, args.weights)
    expected = torch.cat(torch.load(args.predictions, weights_only=True))
    with torch.inference_mode():
        served = net(read_test_images(args.data, expected.shape[0]))
    diff = (served - expected).abs().max().item()
    print(f"{expected.shape[0]} images, {args.model}, {args.weights}")
    served_by = "reference weight-only math" if args.reference else "torchao " + _torchao_version()
    print(f"{served_by} vs fulgur predict: max |diff| = {diff:.3g}")
    if diff > args.tolerance:
        print(f"FAILED: above the tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
