#!/usr/bin/env python3
"""Regenerates the small binary seeds of tests/fuzz/corpus (the TOML seeds are written by hand).

usage: make_seeds.py PLUGIN.so   (any Fulgur plugin: its metadata note seeds the ELF-note target)
Needs torch and safetensors (the venv's python) for the checkpoint and safetensors seeds.
"""
import gzip
import io
import os
import struct
import sys

here = os.path.dirname(os.path.abspath(__file__))
corpus = os.path.join(here, "corpus")


def write(target, name, data):
    os.makedirs(os.path.join(corpus, target), exist_ok=True)
    with open(os.path.join(corpus, target, name), "wb") as f:
        f.write(data)


def note_segment(plugin):
    """The bytes of the PT_NOTE segment that holds the Fulgur note."""
    data = open(plugin, "rb").read()
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz, _, p_align = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        seg = data[p_offset:p_offset + p_filesz]
        if p_type == 4 and b"fulgur\0" in seg:
            return seg, p_align
    raise SystemExit(f"{plugin}: no Fulgur note")


def minimal_elf(segment, align):
    """An ELF64 shared object made of a header, one PT_NOTE program header and the note."""
    ehdr_size, phdr_size = 64, 56
    note_at = ehdr_size + phdr_size
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    ehdr = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, ehdr_size, 0, 0, ehdr_size, phdr_size, 1, 64, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", 4, 4, note_at, note_at, note_at, len(segment), len(segment), align)
    return ehdr + phdr + segment


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    segment, align = note_segment(sys.argv[1])
    write("elf_note", "minimal_plugin.so", minimal_elf(segment, align))
    write("elf_note", "not_elf.bin", b"this is not an ELF file\n")

    labels = struct.pack(">BBBBI", 0, 0, 8, 1, 3) + bytes([1, 2, 9])
    images = struct.pack(">BBBBIII", 0, 0, 8, 3, 2, 2, 2) + bytes(range(8))
    # The first byte selects the expected dimensions (even: 1, odd: 3); the rest is the file.
    write("idx", "labels_plain.bin", b"\x00" + labels)
    write("idx", "images_plain.bin", b"\x01" + images)
    write("idx", "images_gzip.bin", b"\x01" + gzip.compress(images, mtime=0))

    import torch
    buffer = io.BytesIO()
    torch.save({"epoch": 1, "global_step": 4, "state_dict": {"layer.weight": torch.arange(4.0).reshape(2, 2)},
                "optimizer_states": [{"lr": 0.1}], "callbacks": {}}, buffer)
    write("checkpoint", "small.ckpt", buffer.getvalue())
    # What torch.save(model.state_dict()) writes: OrderedDicts with a _metadata attribute, which the
    # reader rewrites to plain dicts (sdk/src/pickle_compat.cpp).
    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict(), buffer)
    write("checkpoint", "state_dict.pt", buffer.getvalue())

    from safetensors.torch import save
    write("safetensors", "small.safetensors",
          save({"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(2, dtype=torch.float16),
                "i": torch.tensor([1, -2]), "b": torch.tensor([True, False])}, metadata={"format": "pt"}))
    write("safetensors", "empty.safetensors", save({}))

    data_seeds()


def data_seeds():
    """The seeds of the data readers and the distributed checkpoint (no plugin needed)."""
    # CSV: the first byte picks the delimiter (bits 0-1: , TAB ; |), skip_corrupt (bit 2), the
    # "label" target (bit 3), a fixed vocabulary for "c" (bit 4) and the columns x, c (bit 5).
    write("csv", "numeric_target.csv", b"\x08x,y,label\n1.5,2,a\n-3,4e2,b\n0,0,a\n")
    write("csv", "quoted_categorical.csv", b'\x18x,c,label\r\n"1",a,"x, ""y"""\r\n2,b,"multi\nline"\r\n')
    write("csv", "tsv_skip_corrupt.tsv", b"\x05x\tc\n1\ta\nnot-a-number\tb\n3\n")
    write("csv", "columns.csv", b"\x28x,c,z,label\n1,a,9,p\n2,b,8,q\n")

    # Images: the first byte picks grey output (bit 0) and skip_corrupt (bit 1).
    from PIL import Image
    def image_bytes(mode, size, fmt, **kw):
        img = Image.new(mode, size)
        img.putdata([tuple((x * 37 + y * 11 + c * 5) % 256 for c in range(len(mode))) if len(mode) > 1
                     else (x * 37 + y * 11) % 256 for y in range(size[1]) for x in range(size[0])]
                    if mode != "P" else [(x + y) % 4 for y in range(size[1]) for x in range(size[0])])
        if mode == "P":
            img.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
        buffer = io.BytesIO()
        img.save(buffer, fmt, **kw)
        return buffer.getvalue()
    write("image", "rgb.png", b"\x00" + image_bytes("RGB", (4, 3), "PNG"))
    write("image", "grey_as_grey.png", b"\x01" + image_bytes("L", (3, 2), "PNG"))
    write("image", "rgba.png", b"\x00" + image_bytes("RGBA", (2, 2), "PNG"))
    write("image", "palette.png", b"\x02" + image_bytes("P", (5, 3), "PNG"))
    write("image", "rgb.jpg", b"\x00" + image_bytes("RGB", (8, 8), "JPEG", quality=50))
    write("image", "grey_progressive.jpg", b"\x01" + image_bytes("L", (9, 5), "JPEG", progressive=True))

    # Tar shards: the first byte picks skip_corrupt (bit 0), the .cls target (bit 1, else .txt) and a
    # .json extra (bit 2).
    import tarfile
    def shard(members, fmt):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()
    samples = [("s/000.jpg", b"\xff\xd8jpeg0"), ("s/000.cls", b"3"), ("s/000.json", b"{}"), ("s/000.txt", b"t"),
               ("s/001.jpg", b"\xff\xd8jpeg1"), ("s/001.cls", b"1\n"), ("s/001.json", b"[]"), ("s/001.txt", b"u")]
    write("tar", "ustar.tar", b"\x06" + shard(samples, tarfile.USTAR_FORMAT))
    long_name = "d" * 120 + "/000"
    write("tar", "pax_long_name.tar",
          b"\x02" + shard([(long_name + ".jpg", b"x"), (long_name + ".cls", b"7")], tarfile.PAX_FORMAT))
    write("tar", "gnu_long_name_missing_member.tar",
          b"\x03" + shard([(long_name + ".jpg", b"x"), ("e/002.jpg", b"y"), ("e/002.cls", b"2")], tarfile.GNU_FORMAT))

    # Token files: byte 0 picks uint32 (bit 0) and skip_corrupt (bit 1); byte 1 the block size, byte 2
    # the stride, byte 3 the vocabulary size / 64; then the tokens.
    write("token", "uint16.bin", bytes([0, 4, 0, 1]) + struct.pack("<12H", *range(12)))
    write("token", "uint32_stride.bin", bytes([1, 3, 2, 0]) + struct.pack("<9I", *range(100, 109)))
    write("token", "out_of_vocab_skip.bin", bytes([2, 2, 1, 1]) + struct.pack("<8H", 1, 2, 3, 64, 5, 6, 7, 8))

    # Distributed checkpoints as Python's torch.distributed.checkpoint writes them (one process):
    # a 4-byte length, `.metadata`, then rank 0's data file.
    import tempfile
    import torch
    import torch.distributed.checkpoint as dcp
    def dcp_seed(name, state):
        with tempfile.TemporaryDirectory() as d:
            dcp.save(state, checkpoint_id=d, no_dist=True)
            metadata = open(os.path.join(d, ".metadata"), "rb").read()
            data = open(os.path.join(d, "__0_0.distcp"), "rb").read()
        write("dcp_metadata", name, struct.pack("<I", len(metadata)) + metadata + data)
    dcp_seed("tensors.dcp", {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)})
    dcp_seed("nested_values.dcp", {"model": {"w": torch.tensor([1, 2], dtype=torch.int64)}, "epoch": 3,
                                   "opt": {"param_groups": [{"lr": 0.1, "params": [0]}]}})


if __name__ == "__main__":
    main()
