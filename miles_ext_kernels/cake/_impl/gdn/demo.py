"""demo(device): a couple of cases against the FP64 reference (tiny through the interpreter on "cpu")."""
from __future__ import annotations

import torch

from miles_ext_kernels.cake._runtime.testing import rel_rms

from .reference import gdn_reference

# Budgets (relative RMS vs the FP64 recurrence). cpu: 2 x our error measured through the interpreter.
# cuda: min(1.1 x fla 0.6.0's forward error, 2 x ours) for o / final state; 2 x ours for gradients (fla's
# backward is not trusted on triton 3.6 Hopper). See tests/cake/gdn/.
BUDGETS = {
    "cpu": {"o": 8.4e-3, "ht": 6.1e-3, "dq": 8.1e-3, "dk": 7.8e-3, "dv": 7.6e-3, "dg": 7.8e-3, "dbeta": 5.9e-3,
            "dh0": 4.8e-3},
    "cuda": {"o": 2e-2, "ht": 2e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2, "dg": 3e-2, "dbeta": 3e-2, "dh0": 3e-2},
}


def make_inputs(lens, H, HV, K, V, device, *, seed=0, h0=True, l2=True, gshift=0.0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*s):
        return torch.randn(*s, generator=gen)

    q = r(1, T, H, K).to(torch.bfloat16)
    k = r(1, T, H, K).to(torch.bfloat16)
    if not l2:
        q = torch.nn.functional.normalize(q.float(), dim=-1).to(torch.bfloat16)
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(r(1, T, HV) + gshift).float()
    beta = torch.rand(1, T, HV, generator=gen).float().sigmoid()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    hs = r(len(lens), HV, K, V).float() * 0.1 if h0 else None
    do = r(1, T, HV, V).to(torch.bfloat16)
    dht = r(len(lens), HV, K, V).float() * 0.1
    out = dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, h0=hs, do=do, dht=dht)
    return {n: (x.to(device) if x is not None else None) for n, x in out.items()}


def run_case(inp, *, l2=True, impl=None):
    """(ours, reference) dicts of o, ht and the gradients."""
    from .ops import chunk_gated_delta_rule

    impl = impl or chunk_gated_delta_rule
    leaves = {n: inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    if inp["h0"] is not None:
        leaves["h0"] = inp["h0"].clone().requires_grad_(True)
    o, ht = impl(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves.get("h0"),
                 output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=inp["cu"])
    (o.float() * inp["do"].float()).sum().add((ht * inp["dht"]).sum()).backward()
    ours = {"o": o.detach(), "ht": ht.detach()}
    ours.update({"d" + ("h0" if n == "h0" else n): t.grad for n, t in leaves.items()})

    ref_leaves = {n: t.detach().to("cpu", torch.float64).requires_grad_(True) for n, t in leaves.items()}
    ro, rht = gdn_reference(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"], ref_leaves["beta"],
                            initial_state=ref_leaves.get("h0"), output_final_state=True,
                            use_qk_l2norm_in_kernel=l2, cu_seqlens=inp["cu"].cpu())
    (ro * inp["do"].cpu().double()).sum().add((rht * inp["dht"].cpu().double()).sum()).backward()
    ref = {"o": ro.detach(), "ht": rht.detach()}
    ref.update({"d" + ("h0" if n == "h0" else n): t.grad for n, t in ref_leaves.items()})
    return ours, ref


def demo(device: str) -> list[dict]:
    dev = "cpu" if device == "cpu" else "cuda"
    if dev == "cpu":
        cases = [("docs 15+70+50, H1/HV2, K=V=32, l2", dict(lens=[15, 70, 50], H=1, HV=2, K=32, V=32), True)]
    else:
        cases = [("docs 15+100+300+1200, H2/HV4, K=V=128, l2", dict(lens=[15, 100, 300, 1200], H=2, HV=4, K=128,
                                                                       V=128), True),
                 ("1 doc 700, H1/HV2, K=V=64", dict(lens=[700], H=1, HV=2, K=64, V=64), False)]
    rows = []
    for case, shape, l2 in cases:
        inp = make_inputs(device=device, l2=l2, **shape)
        ours, ref = run_case(inp, l2=l2)
        for name, got in ours.items():
            err = rel_rms(got, ref[name])
            budget = BUDGETS[dev][name]
            rows.append(dict(op="gdn", case=case, tensor=name, err=err, budget=budget, ok=err <= budget))
    return rows
