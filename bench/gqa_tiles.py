"""Tile candidates of the gqa kernels against FA2 varlen on short and long documents, device ms in one process.

INTERNAL LAUNCHERS (tuning only, as bench/gqa.py's --tune): `ops.gqa_forward` / `gqa_backward` with the config
overridden (the Triton kernels at 128-, 64- or 32-row tiles; "default" is the shipped table at its long-document
route, Gluon where it fits; "short" the short-document route's self-loading kernel; "loader64" the loader-warp kernel
at 64-row tiles), each candidate's bits against the default route's, and FA2 through torch's aten varlen ops. Hq16 /
Hkv2, head dim 256.
Prints only (a tuning aid: the benchmark of record is bench/gqa.py).

    python bench/gqa_tiles.py [CANDIDATE,CANDIDATE,...]
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import device_ms
from gqa import SCALE, make

from miles_ext_kernels.cake._impl.gqa import ops

LAYOUTS = {"256x128": [128] * 256, "1024x32": [32] * 1024, "16x2048": [2048] * 16}
LONG_ONLY = ("default", "short", "tri128", "tri64w4", "tri64w8")  # candidates also run on 16 x 2048


def variants() -> dict:
    base = ops.CONFIGS["sm_90a"]

    def cfg(fwd=None, dq=None, gluon=True):
        c = dict(base)
        if fwd is not None:
            c["fwd"], c["dq"] = fwd, dq
        if not gluon:
            c.pop("fwd_gluon")
            c.pop("dq_gluon")
        return c

    def tri(bm, bn, warps, stages):
        return cfg(dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages, DIAG_ONLY=True),
                   dict(BM=bm, BN=bn, num_warps=warps, num_stages=1), gluon=False)

    def gluon64(**kw):  # a Gluon forward at 64-row tiles
        c = dict(base)
        c["fwd"], c["fwd_gluon"] = base["fwd_short"], kw
        return c

    loader64 = dict(BM=64, BN=64, STAGES=2, num_warps=4, maxnreg=168)  # fwd_kernel with one warpgroup
    return {"default": cfg(), "short": gluon64(**base["fwd_gluon_short"]), "loader64": gluon64(**loader64),
            "loader64s1": gluon64(**dict(loader64, STAGES=1)), "tri128": cfg(gluon=False),
            "tri64w4": tri(64, 64, 4, 2), "tri64w8": tri(64, 64, 8, 2), "tri64bn32": tri(64, 32, 4, 3),
            "tri32bn32": tri(32, 32, 4, 3)}


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else None  # optional: the candidates to run
    for label, lens in LAYOUTS.items():
        q, k, v, do, cu = make(lens, 16, 2)
        L = max(lens)

        def fa_fwd():
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False, scale=SCALE)

        res = fa_fwd()

        def fa_bwd():
            return torch.ops.aten._flash_attention_backward(do, q, k, v, res[0], res[1], cu, cu, L, L, 0.0, True,
                                                            res[2], res[3], scale=SCALE)

        t_ff, t_fb = device_ms(fa_fwd), device_ms(fa_bwd)
        print(f"{label}: FA2 fwd {t_ff:.3f} bwd {t_fb:.3f}", flush=True)
        first = None
        for name, c in variants().items():
            if (label == "16x2048" and name not in LONG_ONLY) or (names and name not in names):
                continue
            out, lse = ops.gqa_forward(q, k, v, cu, cu, SCALE, c)
            bwd = partial(ops.gqa_backward, do, q, k, v, out, lse, cu, cu, SCALE, "det", c)
            t_f = device_ms(partial(ops.gqa_forward, q, k, v, cu, cu, SCALE, c))
            t_dq = device_ms(partial(bwd, ("dq",), L))
            t_b = device_ms(partial(bwd, ("dkdv", "dq"), L))
            got = (out, lse, *bwd(("dkdv", "dq"), L))
            first = first or got
            same = [torch.equal(a, b) for a, b in zip(got, first)]
            err = (out.float() - res[0].float()).norm() / res[0].float().norm()
            print(f"  {name:10s} fwd {t_f:.3f} ({t_ff / t_f:.2f}x FA2)  dq only {t_dq:.3f}  bwd {t_b:.3f} "
                  f"({t_fb / t_b:.2f}x FA2)  bits as default (out, lse, dq, dk, dv) {same}  out vs FA2 {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
