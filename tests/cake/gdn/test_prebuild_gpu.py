"""One prebuild of gdn (head dims 128 / 128), then every route runs under no_build(): in this process, and in
fresh processes that share a cache directory (see tests/cake/_prebuild.py)."""
import importlib

import pytest

import miles_ext_kernels as mek
from tests.cake._prebuild import backward_keeping_det_bits, check_prebuild_here_and_on_a_node, over_state_tiles

pytestmark = pytest.mark.gpu


def every_route():
    """Calls that launch every route: with / without initial state, final state, dht, L2 norm; det and fast;
    kept and recomputed states; int32 and int64 cu_seqlens; the state kernels' wide and narrow tiles. Returns the
    det bits."""
    return over_state_tiles("gdn", _calls)


def _calls():
    d = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
    from miles_ext_kernels.cake import gdn

    out = {}
    for l2 in (True, False):
        for h0 in (True, False):
            for final in (True, False):
                for variant, recompute in (("det", False), ("fast", True)):
                    mek.configure(gdn_variant=variant, gdn_recompute_state=recompute)
                    inp = d.make_inputs([70, 130], 2, 4, 128, 128, "cuda", seed=1, h0=h0, l2=l2)
                    leaves = {n: inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
                    if h0:
                        leaves["h0"] = inp["h0"].clone().requires_grad_(True)
                    o, ht = gdn.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                                       leaves["beta"], initial_state=leaves.get("h0"),
                                                       output_final_state=final, use_qk_l2norm_in_kernel=l2,
                                                       cu_seqlens=inp["cu"] if variant == "det" else inp["cu"].long())
                    backward_keeping_det_bits(out, f"l2={l2}/h0={h0}/final={final}", variant, o, ht, leaves, inp,
                                              final)
    return out  # every_route_bits (tests/cake/_prebuild.py) configures the defaults again and syncs


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "gdn", {"head_k_dim": 128, "head_v_dim": 128},
                                      "tests.cake.gdn.test_prebuild_gpu", ())
