"""The Python side of tests/distributed_checkpoint_test.cpp: torch.distributed.checkpoint (DCP)
reading what Fulgur wrote, and writing what Fulgur must read. Prints "python-ok" on success.

  check DIR EXPECTED        dcp_to_torch_save(DIR) and dcp.load(no_dist=True) equal EXPECTED
  check-file FILE EXPECTED  torch.load(FILE, weights_only=True) equals EXPECTED
  write DIR EXPECTED        dcp.save(no_dist=True) of a fixed state; EXPECTED: what reading it gives
  fsdp2 DIR EXPECTED        2 ranks (Gloo, CPU) save an FSDP2 model and its Adam state with dcp.save

EXPECTED is a torch.save file of the nested state as DCP rebuilds it (string dict keys).
"""

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

warnings.filterwarnings("ignore")  # "torch.distributed is disabled ... assuming a single process"


def same(a, b, where="state"):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b)}"
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}.{i}")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def zeros_like_state(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return None  # non-tensor leaves are replaced by dcp.load


def check(directory, expected_file):
    expected = torch.load(expected_file, weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(directory, full)
        same(torch.load(full, weights_only=False), expected, "dcp_to_torch_save")
    target = zeros_like_state(expected)
    dcp.load(target, checkpoint_id=directory, no_dist=True)
    same(target, expected, "dcp.load")


def fixed_state():
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "layer.weight": torch.randn(7, 3, generator=g),
            "layer.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "steps": torch.arange(10, dtype=torch.int64).reshape(5, 2),
            "scale": torch.tensor(2.5),
        },
        "optim": {
            "state": {0: {"exp_avg": torch.randn(7, 3, generator=g), "step": torch.tensor(12.0)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "name": "main", "flag": True,
                              "decay": None}],
        },
        "epoch": 4,
    }


def as_rebuilt(state):
    """What DCP's set_element rebuilds: every dict key a string."""
    if isinstance(state, dict):
        return {str(k): as_rebuilt(v) for k, v in state.items()}
    if isinstance(state, list):
        return [as_rebuilt(v) for v in state]
    return state


def write(directory, expected_file):
    state = fixed_state()
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    torch.save(as_rebuilt(state), expected_file)


def fsdp2_rank(rank, directory, expected_file, port):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=directory)
    full = {"model": {k: v.full_tensor() for k, v in model_sd.items()},
            "optim": {"state": {k: {n: (t.full_tensor() if hasattr(t, "full_tensor") else t)
                                    for n, t in s.items()} for k, s in optim_sd["state"].items()},
                      "param_groups": optim_sd["param_groups"]}}
    if rank == 0:
        torch.save(as_rebuilt(full), expected_file)
    dist.barrier()
    # Done and checked on every rank; skip Python torch's Gloo teardown, which once aborted a rank
    # after its work was done ("terminate called without an active exception"; see fsdp2_load.py).
    os._exit(0)


def fsdp2(directory, expected_file):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fsdp2_rank, args=(directory, expected_file, port), nprocs=2)


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "check":
        check(*args)
    elif command == "check-file":
        same(torch.load(args[0], weights_only=True), torch.load(args[1], weights_only=True), "file")
    elif command == "write":
        write(*args)
    elif command == "fsdp2":
        fsdp2(*args)
    else:
        raise SystemExit(f"unknown command {command}")
    print("python-ok")


if __name__ == "__main__":
    main()
