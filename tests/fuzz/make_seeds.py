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


if __name__ == "__main__":
    main()
