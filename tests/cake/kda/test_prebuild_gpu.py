"""One prebuild of kda (head dims 128 / 128), then every route runs under no_build(): in this process, and in fresh
processes that share a cache directory (see tests/cake/_prebuild.py)."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from tests.cake._prebuild import backward_keeping_det_bits, check_prebuild_here_and_on_a_node, over_state_tiles

pytestmark = pytest.mark.gpu

# (gate mode, raw-gate dtype): every specialization of the gate kernel and the dg backward
GATES = [("pre", torch.float32), ("softplus", torch.float32), ("softplus", torch.bfloat16), ("safe", torch.float32),
         ("safe", torch.bfloat16)]


def every_route():
    """Calls that launch every route: each gate kind and raw-gate dtype; with / without L2 norm, initial state, final
    state (and dht) in both state layouts; det (int32 cu_seqlens) and fast (int64); the state kernels' wide and
    narrow tiles. Returns the det bits."""
    return over_state_tiles("kda", _calls)


def _combos():
    for l2 in (True, False):
        for h0 in (True, False):
            for final in (True, False):
                for trans in (True, False):
                    yield "pre", torch.float32, l2, h0, final, trans
    for gate, gdt in GATES[1:]:
        yield gate, gdt, True, True, True, True


def _calls():
    d = importlib.import_module("miles_ext_kernels.cake._impl.kda.demo")
    from miles_ext_kernels.cake import kda

    out = {}
    for gate, gdt, l2, h0, final, trans in _combos():
        for variant in ("det", "fast"):
            mek.configure(kda_variant=variant)
            inp = d.make_inputs([70, 130], 2, 4, 128, 128, "cuda", seed=1, h0=h0, l2=l2, gate=gate, trans=trans,
                                gate_dtype=gdt)
            leaves = {n: inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias",
                                                                       "h0") if inp[n] is not None}
            o, ht = kda.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                  initial_state=leaves.get("h0"), output_final_state=final,
                                  use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate != "pre",
                                  A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"), safe_gate=gate == "safe",
                                  lower_bound=inp["lower_bound"], transpose_state_layout=trans,
                                  cu_seqlens=inp["cu"] if variant == "det" else inp["cu"].long())
            key = f"{gate}/{str(gdt)[6:]}/l2={l2}/h0={h0}/final={final}/trans={trans}"
            backward_keeping_det_bits(out, key, variant, o, ht, leaves, inp, final)
    return out  # every_route_bits (tests/cake/_prebuild.py) configures the defaults again and syncs


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "kda", {"head_k_dim": 128, "head_v_dim": 128},
                                      "tests.cake.kda.test_prebuild_gpu", ())
