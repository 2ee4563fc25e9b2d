"""One prebuild of gqa, then every route (Gluon and Triton forwards and dK/dV, dQ, tile prefix; det and fast) runs under
no_build(): in this process, and in fresh processes sharing the cache directory (det bits equal this process')."""
import pytest
import torch

import miles_ext_kernels as mek
from tests.cake._prebuild import check_prebuild_here_and_on_a_node

pytestmark = pytest.mark.gpu


def every_route():
    """Run every route (both variants; odd strides of packed views; padding; ratios 1, 3, 8); return det bits."""
    from miles_ext_kernels.cake import gqa as decl

    out = {}
    # (16 equal documents of 1024 tokens: the Gluon dK/dV pass takes its ROUND order there)
    for hq, hkv, lens in ((8, 1, [300, 0, 517]), (3, 1, [129]), (2, 2, [64, 64]), (3, 1, [1024] * 16)):
        for variant in ("det", "fast"):
            mek.configure(gqa_variant=variant)
            g = torch.Generator().manual_seed(hq)
            T = sum(lens) + 40
            qkv = torch.randn(T, hq + 2 * hkv, 256, generator=g).to("cuda", torch.bfloat16)
            q, k, v = (t.requires_grad_() for t in (qkv[:, :hq].clone(), qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
            k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
            do = torch.randn(T, hq, 256, generator=g).to("cuda", torch.bfloat16)
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
            o, lse = decl.varlen_gqa_attention(q, k, v, cu, cu, max_seqlen_k=max(lens), return_lse=True)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            if variant == "det":
                for name, t in (("out", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
                    out[f"{hq}/{hkv}/{name}"] = t.detach().float().cpu()
    # a head stride other than 256: the Triton forward and dK/dV (the Gluon kernels need a token's heads contiguous)
    mek.configure(gqa_variant="det")
    g = torch.Generator().manual_seed(11)
    wide_q = torch.randn(200, 2, 512, generator=g).to("cuda", torch.bfloat16)[:, :, :256].requires_grad_()
    kv = torch.randn(200, 1, 256, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    cu = torch.tensor([0, 120, 200], dtype=torch.int64, device="cuda")  # the int64 boundaries' tile-prefix route
    o = decl.varlen_gqa_attention(wide_q, kv, kv, cu, cu, max_seqlen_k=120)
    dq, dkv = torch.autograd.grad(o, (wide_q, kv), torch.randn(200, 2, 256, generator=g).to("cuda", torch.bfloat16))
    for name, t in (("out", o), ("dq", dq), ("dkv", dkv)):
        out[f"wide/{name}"] = t.detach().float().cpu()
    return out  # every_route_bits (tests/cake/_prebuild.py) configures the defaults again and syncs


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "gqa", {},
                                      "tests.cake.gqa.test_prebuild_gpu", ())
