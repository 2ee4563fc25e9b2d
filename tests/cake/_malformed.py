"""Malformed cu_seqlens through every op that takes them: no content may make a kernel read or write outside its
tensors (a malformed call may give garbage in its own outputs, never a bad access or a crash).

The operands are views into NaN-filled guard buffers, so a read past a tensor would bring a NaN into an output that
is otherwise finite (gqa and conv1d write every output row; gdn and kda every row of a clamped document). The CPU tests
(interpreter) run these cases; on a GPU `python -m tests.cake._malformed` runs them all and exits 1 on a failure,
and `.ci/gpu` runs that under `compute-sanitizer --tool memcheck`, which sees any bad access itself."""
import sys

import torch

T = 16  # tokens of every case
# cu_seqlens that break the contract (0 = c_0 <= ... <= c_N = T): past T, negative, huge, not starting at 0, falling
CASES = [
    [0, 5, 20],
    [0, -4, 16],
    [0, 5, 2 ** 30],
    [3, 8, 16],
    [0, -4, 20],
    [3, 8, 20],
    [0, 10, 5, 16],
    [16, 0, 16],
    [-(2 ** 31), 2 ** 31 - 1],
]
CASES_INT64 = [[0, 2 ** 40, 16], [-(2 ** 40), 7, 16]]
GUARD = 8  # rows of NaN before and after each operand


def all_cases():
    """(label, cu list, dtype) of every case."""
    out = [(str(c), c, torch.int32) for c in CASES]
    return out + [(f"{c} int64", c, torch.int64) for c in CASES_INT64]


def _guarded(shape, dtype, device, gen):
    """A [T, ...] operand of random values inside a NaN-filled buffer (GUARD rows before and after)."""
    buf = torch.full((T + 2 * GUARD, *shape[1:]), float("nan"), dtype=torch.float32)
    buf[GUARD:GUARD + T] = torch.randn(shape, generator=gen)
    return buf.to(device, dtype)[GUARD:GUARD + T]


def run_gqa(cu, dtype, device):
    """Forward and backward of gqa (check option off); every output row is written and finite."""
    from miles_ext_kernels.cake import gqa

    gen = torch.Generator().manual_seed(0)
    q = _guarded((T, 2, 256), torch.bfloat16, device, gen).requires_grad_()
    k = _guarded((T, 1, 256), torch.bfloat16, device, gen).requires_grad_()
    v = _guarded((T, 1, 256), torch.bfloat16, device, gen).requires_grad_()
    c = torch.tensor(cu, dtype=dtype, device=device)
    out, lse = gqa.varlen_gqa_attention(q, k, v, c, c, max_seqlen_k=T, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen).to(device, out.dtype))
    return {"out": out, "lse": lse.nan_to_num(neginf=0.0), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def run_conv1d(cu, dtype, device):
    """Forward and backward of conv1d (width 4, SiLU); every output row is written and finite."""
    from miles_ext_kernels.cake import conv1d

    gen = torch.Generator().manual_seed(1)
    x = _guarded((T, 64), torch.bfloat16, device, gen).requires_grad_()
    w = torch.randn(64, 4, generator=gen).to(device).requires_grad_()
    c = torch.tensor(cu, dtype=dtype, device=device)
    y = conv1d.causal_conv1d(x, w, cu_seqlens=c)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn(y.shape, generator=gen).to(device, y.dtype))
    return {"y": y, "dx": dx, "dw": dw}


def run_conv1d_halo(cu, dtype, device):
    """conv1d with an initial state that sits between NaN guard documents and holds NaN in entry 0 of every
    document (never read): every output row, and the state's gradient, finite."""
    from miles_ext_kernels.cake import conv1d

    gen = torch.Generator().manual_seed(4)
    x = _guarded((T, 64), torch.bfloat16, device, gen).requires_grad_()
    w = torch.randn(64, 4, generator=gen).to(device).requires_grad_()
    N = len(cu) - 1
    buf = torch.full((N + 2 * GUARD, 64, 4), float("nan"))
    buf[GUARD:GUARD + N, :, 1:] = torch.randn(N, 64, 3, generator=gen)
    h = buf.to(device, torch.bfloat16)[GUARD:GUARD + N].requires_grad_()
    c = torch.tensor(cu, dtype=dtype, device=device)
    y = conv1d.causal_conv1d(x, w, cu_seqlens=c, initial_state=h)
    dx, dw, dh = torch.autograd.grad(y, (x, w, h), torch.randn(y.shape, generator=gen).to(device, y.dtype))
    return {"y": y, "dx": dx, "dw": dw, "dh": dh}


def run_gdn(cu, dtype, device):
    """Forward and backward of gdn's launchers (the public entry point refuses a malformed cu_seqlens on CPU); the
    rows of every clamped document are finite (rows outside all documents are undefined by the contract)."""
    import importlib

    ops = importlib.import_module("miles_ext_kernels.cake._impl.gdn.ops")
    gen = torch.Generator().manual_seed(2)
    q = _guarded((T, 1, 16), torch.bfloat16, device, gen)[None]
    k = _guarded((T, 1, 16), torch.bfloat16, device, gen)[None]
    v = _guarded((T, 2, 16), torch.bfloat16, device, gen)[None]
    g = torch.nn.functional.logsigmoid(_guarded((T, 2), torch.float32, device, gen))[None]
    beta = torch.sigmoid(_guarded((T, 2), torch.float32, device, gen))[None]
    c = torch.tensor(cu, dtype=dtype, device=device)
    o, ht, qn, kk, gc, A, w, h, vn, se, table = ops.gdn_forward(q, k, v, g, beta, None, c, 0.25, True, True, True)
    do = torch.randn(o.shape, generator=gen).to(device, o.dtype)
    dq, dk, dv, dg, db, _ = ops.gdn_backward(do, None, q, k, qn, kk, v, g, beta, None, gc, A, w, h, vn, se, table,
                                             0.25, True, True)
    rows = torch.zeros(T, dtype=torch.bool)
    for b, e in se.cpu().tolist():
        rows[b:e] = True
    rows = rows.to(device)
    return {"o": o[0][rows], "ht": ht, "dq": dq[0][rows], "dk": dk[0][rows], "dv": dv[0][rows], "dg": dg[0][rows],
            "dbeta": db[0][rows]}


def run_kda(cu, dtype, device):
    """Forward and backward of kda's launchers with the in-kernel softplus gate (its per-chunk dA_log / ddt_bias
    partials too); the rows of every clamped document are finite, and so are the gate-parameter gradients."""
    import importlib

    ops = importlib.import_module("miles_ext_kernels.cake._impl.kda.ops")
    gen = torch.Generator().manual_seed(3)
    q = _guarded((T, 1, 16), torch.bfloat16, device, gen)[None]
    k = _guarded((T, 1, 16), torch.bfloat16, device, gen)[None]
    v = _guarded((T, 2, 16), torch.bfloat16, device, gen)[None]
    g = _guarded((T, 2, 16), torch.float32, device, gen)[None]  # the raw gate
    beta = torch.sigmoid(_guarded((T, 2), torch.float32, device, gen))[None]
    A_log = torch.zeros(2, device=device)
    dt_bias = torch.zeros(32, device=device)
    c = torch.tensor(cu, dtype=dtype, device=device)
    gate = ops.gate_kind(True, None)
    res = ops.kda_forward(q, k, v, g, beta, A_log, dt_bias, None, c, 0.25, 0.0, gate, True, True, False)
    o, ht, se = res[0], res[1], res[10]
    do = torch.randn(o.shape, generator=gen).to(device, o.dtype)
    dq, dk, dv, dg, db, dA, ddt, _ = ops.kda_backward(do, None, q, k, *res[2:4], v, g, beta, A_log, dt_bias, None,
                                                      *res[4:], 0.25, 0.0, gate, True, False)
    rows = torch.zeros(T, dtype=torch.bool)
    for b, e in se.cpu().tolist():
        rows[b:e] = True
    rows = rows.to(device)
    return {"o": o[0][rows], "ht": ht, "dq": dq[0][rows], "dk": dk[0][rows], "dv": dv[0][rows], "dg": dg[0][rows],
            "dbeta": db[0][rows], "dA_log": dA, "ddt_bias": ddt}


RUNNERS = {"gqa": run_gqa, "conv1d": run_conv1d, "conv1d_halo": run_conv1d_halo, "gdn": run_gdn, "kda": run_kda}


def non_finite(outs: dict) -> list:
    return [n for n, t in outs.items() if not bool(torch.isfinite(t.float()).all())]


def main() -> int:
    failed = 0
    for op, run in RUNNERS.items():
        for label, cu, dtype in all_cases():
            bad = non_finite(run(cu, dtype, "cuda"))
            torch.cuda.synchronize()
            print(f"{op:7s} {label:28s} {'non-finite: ' + ', '.join(bad) if bad else 'ok'}", flush=True)
            failed += bool(bad)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
