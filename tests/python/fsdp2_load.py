"""A PyTorch FSDP2 run on CPU/Gloo (torchrun, 2 ranks) loading a checkpoint Fulgur's `fsdp` strategy
wrote with state_dict_type = "sharded" while training tests/ddp_worker.cpp's model, with dcp.load
into its own DTensor shards. Each rank compares the loaded parameters, made whole, with EXPECTED (a
torch.save file of the same step's gathered state_dict) and rank 0 prints "fsdp2-load-ok".

  torchrun --standalone --nproc_per_node=2 fsdp2_load.py CHECKPOINT_DIR EXPECTED
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

warnings.filterwarnings("ignore")


class Mlp(torch.nn.Module):
    """tests/ddp_worker.cpp's model with FULGUR_TEST_SHARDING_MODEL and FULGUR_TEST_UNUSED_LAYER."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.unused = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.frozen = torch.nn.Linear(4, 4)


def main(directory, expected_file):
    dist.init_process_group("gloo")
    model = Mlp()
    # fc1 and fc2 sharded (Fulgur's blocks). FSDP2 refuses 0-dim parameters (`scale`, which Fulgur
    # shards as one row on rank 0), so the root stays unsharded: those load as plain tensors.
    for layer in (model.fc1, model.fc2):
        fully_shard(layer)
    state = {"state_dict": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=directory)
    expected = torch.load(expected_file, weights_only=True)["state_dict"]
    loaded = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.state_dict().items()}
    assert set(loaded) == set(expected), f"keys {sorted(loaded)} vs {sorted(expected)}"
    for name, value in expected.items():
        assert loaded[name].shape == value.shape, f"{name}: shape {tuple(loaded[name].shape)} vs {tuple(value.shape)}"
        assert torch.equal(loaded[name].detach(), value), f"{name}: values differ"
    # Each rank really holds a shard, not a replica.
    local = model.fc1.weight.to_local()
    assert local.shape[0] == 16, f"fc1.weight local shard has {local.shape[0]} rows"
    dist.barrier()
    if dist.get_rank() == 0:
        print("fsdp2-load-ok", flush=True)
    # Every rank has checked its shards. Python torch's Gloo teardown (destroy_process_group and the
    # interpreter's exit) once aborted rank 0 after this point ("terminate called without an active
    # exception"), failing a run whose checks had passed; leave without it.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
