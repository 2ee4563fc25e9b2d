"""One distributed rank of the CP tests (tests/cake/cp/test_cp_gloo_cpu.py: gloo, interpreter;
tests/cake/cp/test_cp_nccl_gpu.py: NCCL, one GPU per rank):
    python -m tests.cake.cp._gloo_rank OP LAYOUT LENS_JSON OUT_DIR [DIMS_JSON]
env: RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT; CP_BACKEND (gloo, default, or nccl: this rank on cuda:RANK).
Saves its outputs and gradients (on the host) and whether a second call repeated them bit for bit. OP rmsnorm_sp:
rmsnorm under sequence parallelism (`_cases.rmsnorm_sp_rank`)."""
import json
import os
import sys

BACKEND = os.environ.get("CP_BACKEND", "gloo")
if BACKEND == "gloo":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    op, layout, lens, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    rank = int(os.environ["RANK"])
    device = "cpu"
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(BACKEND, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    from tests.cake.cp import _cases

    dims = json.loads(sys.argv[5]) if len(sys.argv) > 5 else _cases.TINY
    if op == "rmsnorm_sp":
        torch.save(_cases.rmsnorm_sp_rank(lens, dims, device, dist.group.WORLD), os.path.join(out, f"rank{rank}.pt"))
        dist.destroy_process_group()
        return
    inp = _cases.inputs(op, lens, dims, device)
    ctx = _cases.context(op, inp, dist.group.WORLD, layout)
    res = _cases.run_rank(op, inp, ctx)
    again = _cases.run_rank(op, inp, ctx)
    res = {n: t.cpu() for n, t in res.items()}
    res["_repeats"] = all(torch.equal(res[n], again[n].cpu()) for n in again)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
