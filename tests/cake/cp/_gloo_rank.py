"""One gloo rank of tests/cake/cp/test_cp_gloo_cpu.py:
    python -m tests.cake.cp._gloo_rank OP LAYOUT LENS_JSON OUT_DIR     (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT)"""
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    op, layout, lens, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from miles_ext_kernels import cake
    from tests.cake.cp import _cases

    inp = _cases.inputs(op, lens)
    ctx = cake.build_cp_context(inp["cu"], dist.group.WORLD, layout=layout)
    res = _cases.run_rank(op, inp, ctx)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
