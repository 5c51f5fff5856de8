"""Python's side of tests/tensor_parallel_test.cpp: PyTorch's own tensor parallelism reads the
checkpoint the model_parallel strategy wrote.

    tp_dcp_interop.py <fulgur_dir> <dp> <tp> <one_process_file> <python_dir> [<resaved_dir>]

dp x tp Gloo ranks build tp_mlp (col = Linear(8, 32), row = Linear(32, 4)) with parallelize_module
(ColwiseParallel, RowwiseParallel) on the "tp" dimension of init_device_mesh("cpu", (dp, tp)), and
fully_shard on "dp" when dp > 1 (torchtitan's 2D), then dcp.load the model state Fulgur wrote. The
whole tensors must equal `one_process_file`'s (the same training in one process, saved as a plain
file; equal up to float rounding). Each rank then dcp.save's its model into `python_dir`: the
chunks PyTorch writes there must be the chunks Fulgur wrote (offsets and sizes, per tensor), and
Fulgur's optimizer moments are chunked as their parameters. With <resaved_dir>, the ranks also
dcp.save a whole training checkpoint there (Fulgur's, read with dcp_to_torch_save, its model state
the DTensors just loaded), for Fulgur to resume from. Prints "python-ok".
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

NAMES = ["col.weight", "col.bias", "row.weight", "row.bias"]  # the optimizer's parameter order


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.col = torch.nn.Linear(8, 32)
        self.row = torch.nn.Linear(32, 4)


def chunks(metadata, key):
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata.state_dict_metadata[key].chunks)


def rank_main(rank, dp, tp, fulgur_dir, one_process_file, python_dir, resaved_dir, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = Mlp()
    parallelize_module(model, mesh["tp"], {"col": ColwiseParallel(), "row": RowwiseParallel()})
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    state = {"state_dict": model.state_dict()}
    with torch.no_grad():  # a tensor dcp.load leaves alone shows as zeros
        for value in state["state_dict"].values():
            value.to_local().zero_()
    dcp.load(state, checkpoint_id=fulgur_dir)
    reference = torch.load(one_process_file, weights_only=True)["state_dict"]
    for name in NAMES:
        whole = state["state_dict"][name].full_tensor()
        torch.testing.assert_close(whole, reference[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")

    dcp.save(state, checkpoint_id=python_dir)
    if rank == 0:
        ours = dcp.FileSystemReader(fulgur_dir).read_metadata()
        theirs = dcp.FileSystemReader(python_dir).read_metadata()
        for index, name in enumerate(NAMES):
            key = "state_dict." + name
            assert chunks(ours, key) == chunks(theirs, key), (key, chunks(ours, key), chunks(theirs, key))
            for moment in ("exp_avg", "exp_avg_sq"):
                assert chunks(ours, f"optimizer_states.0.state.{index}.{moment}") == chunks(ours, key), (name, moment)
            print(f"{key}: {chunks(ours, key)}")
    if resaved_dir:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole_file = os.path.join(python_dir, "whole.pt")
        if rank == 0:
            dcp_to_torch_save(fulgur_dir, whole_file)
        dist.barrier()
        everything = torch.load(whole_file, weights_only=True)
        everything["state_dict"] = state["state_dict"]
        dcp.save(everything, checkpoint_id=resaved_dir)
    dist.barrier()
    sys.stdout.flush()
    # Done and checked on every rank; skip Python torch's Gloo teardown, which once aborted a rank
    # after its work was done (see dcp_interop.py).
    os._exit(0)


def main():
    fulgur_dir, dp, tp, one_process_file, python_dir = sys.argv[1:6]
    resaved_dir = sys.argv[6] if len(sys.argv) > 6 else ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(int(dp), int(tp), fulgur_dir, one_process_file, python_dir, resaved_dir, port), nprocs=int(dp) * int(tp))
    print("python-ok")


if __name__ == "__main__":
    main()
