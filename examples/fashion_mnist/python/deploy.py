"""Serve Fulgur-trained Fashion-MNIST weights from Python: ONNX + onnxruntime, or an AOTInductor package.

    # Check that eager PyTorch and onnxruntime reproduce `fulgur predict` (exit 1 if not):
    python deploy.py onnx --model fashion_mnist_cnn --weights model.safetensors \\
        --predictions predictions.pt --data /usr/share/datasets/fashion-mnist --out model.onnx
    # Export an AOTInductor package once; C++ swaps trained weights into it by name
    # (build/bin/fashion_mnist_infer --aoti model.pt2 --weights model.safetensors ...):
    python deploy.py aoti --model fashion_mnist_cnn --out model.pt2

The weights file is what `fulgur weights convert <run>.ckpt model.safetensors` writes; the
predictions file is what `fulgur predict` writes (a list of one [batch, 10] tensor per batch, in
test-set order).
"""

import argparse
import sys

import torch
from safetensors.torch import load_file

from fashion_mnist_nets import make_net, read_test_images


def load_trained(model: str, weights: str) -> torch.nn.Module:
    net = make_net(model)
    # strict: a name or shape that differs between this file and the C++ class is an error here,
    # not a silently half-initialized net.
    net.load_state_dict(load_file(weights), strict=True)
    return net.eval()


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise SystemExit(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a - b).abs().max().item()


def onnx_command(args: argparse.Namespace) -> int:
    import onnxruntime

    net = load_trained(args.model, args.weights)
    expected = torch.cat(torch.load(args.predictions, weights_only=True))
    images = read_test_images(args.data, expected.shape[0])
    with torch.inference_mode():
        eager = net(images)
    # The dynamo exporter (torch.export underneath) with a dynamic batch dimension.
    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(net, (images,), dynamic_shapes={"images": {0: batch}}, dynamo=True)
    program.save(args.out)
    session = onnxruntime.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    served = torch.from_numpy(session.run(None, {input_name: images.numpy()})[0])
    eager_diff = max_difference(eager, expected)
    onnx_diff = max_difference(served, expected)
    print(f"{expected.shape[0]} images, {args.model}")
    print(f"eager PyTorch vs fulgur predict: max |diff| = {eager_diff:.3g}")
    print(f"onnxruntime vs fulgur predict:   max |diff| = {onnx_diff:.3g} ({args.out})")
    ok = eager_diff <= args.tolerance and onnx_diff <= args.tolerance
    if not ok:
        print(f"FAILED: above the tolerance {args.tolerance:g}", file=sys.stderr)
    return 0 if ok else 1


def aoti_command(args: argparse.Namespace) -> int:
    import torch._inductor.config as inductor_config

    torch.manual_seed(args.seed)
    net = make_net(args.model).eval()  # the weights are swapped in from C++: any values do
    # Without it Inductor inlines small constants (biases) into the kernels, and C++ could not
    # replace them: update_constant_buffer would miss them without a word.
    inductor_config.always_keep_tensor_constants = True
    example = (torch.zeros(2, 1, 28, 28),)
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(net, example, dynamic_shapes={"images": {0: batch}})
    path = torch._inductor.aoti_compile_and_package(program, package_path=args.out)
    print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    onnx = commands.add_parser("onnx", help="export to ONNX and compare eager and onnxruntime with fulgur predict")
    onnx.add_argument("--model", required=True, help="fashion_mnist_cnn or fashion_mnist_mlp")
    onnx.add_argument("--weights", required=True, help="safetensors file from `fulgur weights convert`")
    onnx.add_argument("--predictions", required=True, help="predictions.pt from `fulgur predict`")
    onnx.add_argument("--data", required=True, help="the Fashion-MNIST directory (t10k-images-idx3-ubyte.gz)")
    onnx.add_argument("--out", required=True, help="where to write the .onnx file")
    onnx.add_argument("--tolerance", type=float, default=1e-5, help="largest absolute difference accepted")
    aoti = commands.add_parser("aoti", help="export an AOTInductor package whose weights C++ replaces")
    aoti.add_argument("--model", required=True, help="fashion_mnist_cnn or fashion_mnist_mlp")
    aoti.add_argument("--out", required=True, help="where to write the .pt2 package")
    aoti.add_argument("--seed", type=int, default=0, help="seed of the placeholder weights")
    args = parser.parse_args()
    return onnx_command(args) if args.command == "onnx" else aoti_command(args)


if __name__ == "__main__":
    sys.exit(main())
