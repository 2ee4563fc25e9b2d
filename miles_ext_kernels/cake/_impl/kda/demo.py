"""demo(device): a case against the FP64 reference (tiny through the interpreter on "cpu"); the inputs and runners the
tests share.

Errors are relative RMS against the FP64 per-token recurrence, except dA_log and ddt_bias: each is a sum over every
token of a head (and over key dimensions for dA_log), whose cancellation makes a plain relative error meaningless at
one head, so their error is ||got - ref|| over the root sum of squares of their FP64 terms
(`reference.gate_param_terms`).
"""
from __future__ import annotations

import torch

from miles_ext_kernels.cake._runtime.testing import rel_rms

from ..delta_rule import cases
from .reference import gate_param_terms, kda_gate, kda_reference

GATE_MODES = ("pre", "softplus", "safe")  # the log decay given; the in-kernel gate; the in-kernel lower-bound gate
SAFE_LB = -5.0
SUM_TERMS = ("dA_log", "ddt_bias")  # measured over their terms' root sum of squares

# Budgets, 2 x our measured errors (each rejects a 2 % error):
# cpu: the interpreter case of demo() below ([15, 70, 50], H1/HV2, K=V=32, L2 norm, safe gate, transposed states),
#   whose bf16 intermediates are rounded to nearest and tf32 operands rounded as on the GPU (kernels._rnd, _tdot).
#   Measured with the dq / dk partials in fp32 (configs.py `final`): o 4.35e-3, ht 2.72e-3, dq 2.88e-3, dk 2.89e-3,
#   dv 3.76e-3, dg 3.20e-3, dbeta 3.42e-3, dA_log 1.89e-3, ddt_bias 4.52e-3, dh0 2.71e-3 (the other budgets date from
#   the bf16 partials: dg 3.48e-3, dA_log 5.01e-3, ddt_bias 8.65e-3, and also cover the CPU tests' other cases).
# cuda: the CPU budgets; tests/cake/kda/test_kda_gpu.py tightens each to min(budget, 1.1 x fla 0.6.0's error on the
#   same inputs) when fla is importable (H100, fla in the same process: ours 0.84 - 1.009x fla's per tensor).
_CPU = {"o": 8.8e-3, "ht": 5.5e-3, "dq": 5.8e-3, "dk": 5.8e-3, "dv": 7.6e-3, "dg": 7.0e-3, "dbeta": 6.9e-3,
        "dA_log": 1.0e-2, "ddt_bias": 1.73e-2, "dh0": 5.5e-3}
BUDGETS = {"cpu": _CPU, "cuda": dict(_CPU)}

LENS_GPU = [15, 100, 300, 1200, 64, 1]


def make_inputs(lens, H, HV, K, V, device, *, seed=0, h0=True, l2=True, gate="pre", decay=None, trans=False,
                gate_dtype=torch.float32, beta_dtype=torch.float32):
    """Inputs of one case: q, k, v bf16; g (the log decay for gate="pre", else the raw gate in gate_dtype); A_log,
    dt_bias (gated modes); beta; cu; h0 (or None) and dht in the chosen state layout; do. decay: a per-token log decay
    of about that value (pre-gated) instead of logsigmoid draws."""
    r, gen, q, k, v = cases.draw_qkv(lens, H, HV, K, V, seed=seed, l2=l2)
    T = sum(lens)
    A_log = dt_bias = lb = None
    if gate == "pre":
        if decay is None:
            g = torch.nn.functional.logsigmoid(r(1, T, HV, K) + 1.0).float()
        else:
            g = (decay + 0.1 * torch.rand(1, T, HV, K, generator=gen)).float()
    else:
        g = r(1, T, HV, K).to(gate_dtype)
        A_log = (0.5 * r(HV)).float()
        dt_bias = (0.5 * r(HV * K)).float()
        lb = SAFE_LB if gate == "safe" else None
    beta = torch.rand(1, T, HV, generator=gen).to(beta_dtype)
    cu = cases.cu_of(lens)
    shape = (len(lens), HV, V, K) if trans else (len(lens), HV, K, V)
    hs = r(*shape).float() * 0.1 if h0 else None
    do = r(1, T, HV, V).to(torch.bfloat16)
    dht = r(*shape).float() * 0.1
    out = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu=cu, h0=hs, do=do, dht=dht)
    out = cases.to_device(out, device)
    out.update(gate=gate, lower_bound=lb, trans=trans)
    return out


def _kwargs(inp, l2, cu, final):
    gated = inp["gate"] != "pre"
    return dict(output_final_state=final, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gated,
                safe_gate=inp["gate"] == "safe", lower_bound=inp["lower_bound"],
                transpose_state_layout=inp["trans"], cu_seqlens=inp["cu"] if cu else None)


def _leaves(inp, dtype=None, device=None):
    names = ["q", "k", "v", "g", "beta"] + [n for n in ("A_log", "dt_bias", "h0") if inp[n] is not None]
    return {n: (inp[n].detach().to(device or inp[n].device, dtype or inp[n].dtype) if dtype
                else inp[n].clone()).requires_grad_(True) for n in names}


def run_impl(inp, *, l2=True, impl=None, cu=True, final=True):
    """Dict of o, ht and the gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 where they exist) of one
    implementation (ours by default; `impl` takes chunk_kda's arguments)."""
    from .ops import chunk_kda

    impl = impl or chunk_kda
    leaves = _leaves(inp)
    o, ht = impl(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves.get("h0"),
                 A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"), **_kwargs(inp, l2, cu, final))
    return cases.backward(o, ht, leaves, inp["do"], inp["dht"], final=final)


def run_reference(inp, *, l2=True, device="cpu", cu=True, final=True):
    """The FP64 per-token recurrence on the same inputs: o, ht, the gradients, and (gated modes) "rss_dA_log",
    "rss_ddt_bias": the root sum of squares of the terms those two sums add."""
    leaves = _leaves(inp, torch.float64, device)
    kw = _kwargs(inp, l2, cu, final)
    kw["cu_seqlens"] = inp["cu"].cpu() if cu else None
    g = leaves["g"]
    if inp["gate"] != "pre":  # the gate outside the recurrence, to read the gradient of the gated log decay
        g = kda_gate(leaves["g"], leaves["A_log"], leaves["dt_bias"], inp["lower_bound"])
        g.retain_grad()
    kw["use_gate_in_kernel"] = False
    ro, rht = kda_reference(leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"], initial_state=leaves.get("h0"),
                            **kw)
    ref = cases.backward(ro, rht, leaves, inp["do"], inp["dht"], final=final, dtype=torch.float64)
    if inp["gate"] != "pre":
        ta, tb = gate_param_terms(leaves["g"].detach(), leaves["A_log"].detach(), leaves["dt_bias"].detach(),
                                  g.grad, inp["lower_bound"])
        ref["rss_dA_log"] = float(torch.linalg.vector_norm(ta))
        ref["rss_ddt_bias"] = float(torch.linalg.vector_norm(tb))
    return ref


def error(name: str, got: torch.Tensor, ref: dict) -> float:
    """Relative RMS error of `got` against ref[name]; dA_log / ddt_bias over their terms' root sum of squares."""
    if name in SUM_TERMS:
        d = torch.linalg.vector_norm(got.detach().double().cpu() - ref[name].double().cpu()).item()
        return d / ref["rss_" + name] if torch.isfinite(got).all() else float("inf")
    return rel_rms(got, ref[name])


def check_budget(name: str, got: torch.Tensor, ref: dict, budget: float) -> float:
    """Assert error(name) <= budget and that a 2 %-wrong result (got * 1.02) would fail it; return the error."""
    err = error(name, got, ref)
    assert err <= budget, f"{name}: error {err:.3e} exceeds budget {budget:.3e}"
    wrong = error(name, got.detach().double() * 1.02, ref)
    assert wrong > budget, f"{name}: budget {budget:.3e} is too loose: it accepts a 2 % error ({wrong:.3e})"
    return err


def run_case(inp, *, l2=True, impl=None, ref_device="cpu"):
    """(ours, reference) dicts of o, ht and the gradients."""
    return run_impl(inp, l2=l2, impl=impl), run_reference(inp, l2=l2, device=ref_device)


def demo(device: str) -> list[dict]:
    dev = "cpu" if device == "cpu" else "cuda"
    if dev == "cpu":
        todo = [("docs 15+70+50, H1/HV2, K=V=32, l2, safe gate, [V, K] states",
                 dict(lens=[15, 70, 50], H=1, HV=2, K=32, V=32))]
    else:
        todo = [("docs 15+100+300+1200+64+1, H32/HV32, K=V=128, l2, safe gate, [V, K] states",
                 dict(lens=LENS_GPU, H=32, HV=32, K=128, V=128))]
    runs = ((case, *run_case(make_inputs(device=device, l2=True, gate="safe", trans=True, **shape), l2=True,
                             ref_device=device)) for case, shape in todo)
    return cases.demo_rows("kda", BUDGETS[dev], runs, error)
