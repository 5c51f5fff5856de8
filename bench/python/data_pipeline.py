"""Images/s through an image-folder pipeline: Fulgur's DataLoader (bench_data_pipeline, C++ worker
threads) against PyTorch's DataLoader with torchvision transforms (worker processes), on the same
generated JPEG files (bench/data_pipeline.sh runs this).

Pipeline on both sides: decode (libjpeg-turbo on both: Debian's in Fulgur, Pillow's bundled copy
in torchvision), RandomResizedCrop(224) (antialiased bilinear), RandomHorizontalFlip, ToTensor +
Normalize (ImageNet statistics), shuffled batches of 64. Each (workers, side, run) is its own
process; runs are interleaved so that a busy phase of a shared machine hits both sides alike.
Throughput counts the images after each epoch's first batch (steady state: PyTorch's worker
start-up and Fulgur's thread start are left out alike); the whole-epoch figure is printed too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def generate(root, count, classes, width, height, seed):
    """JPEG files (quality 90) of smooth random content, one folder per class, ImageNet-like sizes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c:02d}"), exist_ok=True)
    for i in range(count):
        # Low-frequency noise upsampled: compresses like a photograph, not like white noise.
        small = rng.integers(0, 256, size=(height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((width, height), Image.BICUBIC)
        detail = rng.integers(-12, 13, size=(height, width, 3))
        arr = np.clip(np.asarray(img, dtype=np.int16) + detail, 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(os.path.join(root, f"class{i % classes:02d}", f"{i:05d}.jpg"), quality=90)


def torch_side(root, workers, epochs, batch):
    """Runs in its own process: PyTorch's DataLoader with torchvision transforms."""
    import torch
    from torchvision import datasets, transforms

    t = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    loader = torch.utils.data.DataLoader(datasets.ImageFolder(root, t), batch_size=batch, shuffle=True,
                                         num_workers=workers)
    steady_images = steady_seconds = all_images = all_seconds = 0.0
    for _ in range(epochs):
        start = time.perf_counter()
        first = None
        images = after_first = 0
        for x, _y in loader:
            images += x.shape[0]
            if first is None:
                first = time.perf_counter()
            else:
                after_first += x.shape[0]
        end = time.perf_counter()
        steady_images += after_first
        steady_seconds += end - first
        all_images += images
        all_seconds += end - start
    print(json.dumps({"images_per_s": steady_images / steady_seconds,
                      "images_per_s_whole_epoch": all_images / all_seconds, "images": all_images}))


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", required=False, help="path of bench_data_pipeline")
    p.add_argument("--images", type=int, default=640)
    p.add_argument("--size", default="500x375", help="generated image size WxH")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dir", help="use this image folder instead of generating one")
    p.add_argument("--torch-side", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.torch_side:
        torch_side(a.dir, int(a.torch_side), a.epochs, a.batch_size)
        return
    if not a.bench:
        p.error("--bench is required")

    with tempfile.TemporaryDirectory(prefix="fulgur-data-bench-") as tmp:
        root = a.dir
        if root is None:
            root = os.path.join(tmp, "images")
            w, h = (int(v) for v in a.size.split("x"))
            t0 = time.perf_counter()
            generate(root, a.images, 10, w, h, seed=0)
            print(f"generated {a.images} JPEG files of {w}x{h} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        workers = [int(w) for w in a.workers.split(",")]
        sides = {
            "fulgur": lambda w: [a.bench, "--dir", root, "--workers", str(w), "--epochs", str(a.epochs),
                                 "--batch-size", str(a.batch_size)],
            "pytorch": lambda w: [sys.executable, os.path.abspath(__file__), "--dir", root, "--torch-side", str(w),
                                  "--epochs", str(a.epochs), "--batch-size", str(a.batch_size)],
        }
        results = {(s, w): [] for s in sides for w in workers}
        for r in range(a.runs):
            order = list(sides) if r % 2 == 0 else list(reversed(list(sides)))
            for w in workers:
                for s in order:
                    res = run(sides[s](w))
                    results[(s, w)].append(res)
                    print(f"run {r} workers {w} {s}: {res['images_per_s']:.1f} images/s", file=sys.stderr)

    def med(vals):
        return statistics.median(vals), min(vals), max(vals)

    print(f"\n## Image-folder pipeline, images/s ({a.images} JPEG {a.size}, batch {a.batch_size}, "
          f"{a.epochs} epochs per run, {a.runs} interleaved runs; median [min-max])\n")
    print("| workers | Fulgur (threads) | PyTorch DataLoader + torchvision (processes) | ratio Fulgur / PyTorch |")
    print("|---|---|---|---|")
    for w in workers:
        f = med([x["images_per_s"] for x in results[("fulgur", w)]])
        t = med([x["images_per_s"] for x in results[("pytorch", w)]])
        print(f"| {w} | {f[0]:.0f} [{f[1]:.0f}-{f[2]:.0f}] | {t[0]:.0f} [{t[1]:.0f}-{t[2]:.0f}] | {f[0] / t[0]:.2f} |")
    print("\nWhole epoch including start-up (worker processes / threads), images/s, median:\n")
    print("| workers | Fulgur | PyTorch | ratio |")
    print("|---|---|---|---|")
    for w in workers:
        f = statistics.median([x["images_per_s_whole_epoch"] for x in results[("fulgur", w)]])
        t = statistics.median([x["images_per_s_whole_epoch"] for x in results[("pytorch", w)]])
        print(f"| {w} | {f:.0f} | {t:.0f} | {f / t:.2f} |")
    print(f"\nMachine: {os.cpu_count()} CPUs; ratios mean little unless the machine is otherwise idle.")


if __name__ == "__main__":
    main()
