"""The torch.distributed wiring of context parallelism: W gloo ranks (one process each, Triton's interpreter) call
the public entry points with `cake.build_cp_context`, and their outputs and gradients equal, bit for bit, the W
simulated ranks of one process (which tests/cake/<op>/test_<op>_cp_cpu.py holds to the FP64 recurrence)."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from miles_ext_kernels.cake._runtime import cp as rcp
from tests._paths import ROOT
from tests.cake.cp import _cases

pytestmark = pytest.mark.interpreter

CASES = [("gdn", "contiguous", 2, [100, 60, 0, 32]), ("gdn", "zigzag", 3, [66, 12]),
         ("kda", "contiguous", 3, [150, 0, 30]), ("kda", "zigzag", 2, [64, 8])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("op, layout, world, lens", CASES)
def test_gloo_ranks_equal_simulated_ranks(op, layout, world, lens, tmp_path):
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.cake.cp._gloo_rank", op, layout, json.dumps(lens),
                                       str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    inp = _cases.inputs(op, lens)
    want = _cases.run_simulated(op, inp, layout, world)
    ctxs = rcp.simulated_contexts(inp["cu"], world, layout=layout)
    for name, ref in want.items():
        if name in ("dA_log", "dt_bias", "ddt_bias"):  # per-rank partials: summed in rank order, as simulate does
            got = ranks[0][name].clone()
            for r in ranks[1:]:
                got += r[name]
        else:
            got = rcp.unshard([r[name] for r in ranks], ctxs)
        assert torch.equal(got, ref), name
