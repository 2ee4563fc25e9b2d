"""conv1d through Triton's interpreter on CPU tensors: the real kernels on tiny shapes.

The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest), which doubles the bf16 output
error; the budgets here are set from what the interpreter measures (about half of each budget).
"""
import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import conv1d
from miles_ext_kernels.cake._impl.conv1d import configs, ops, routes
from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_grads
from miles_ext_kernels.cake._runtime.testing import check_budget, rel_rms
from tests._paths import ROOT
from tests.cake._helpers import assert_demo_passes

pytestmark = pytest.mark.interpreter

BUDGET = {"y": 7e-3, "dx": 7e-3, "dw32": 4e-3, "dw16": 8e-3}


def make(T, D, W, wdt=torch.float32, seed=0, x_cols=None, x_off=0):
    g = torch.Generator().manual_seed(seed)
    if x_cols is None:
        x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    else:  # a column slice of a wider projection
        x = torch.randn(T, x_cols, generator=g).to(torch.bfloat16)[:, x_off:x_off + D]
    w = (torch.randn(D, W, generator=g) * 0.5).to(wdt)
    dy = torch.randn(T, D, generator=g).to(torch.bfloat16)
    return x, w, dy


def run(x, w, dy, cu, activation="silu"):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    y = conv1d.causal_conv1d(x, w, cu_seqlens=cu, activation=activation)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _check(got, ref, dw_budget="dw32"):
    """y, dx and dw of `got` within their budgets of the reference's `ref` (dw's budget: BUDGET[dw_budget])."""
    for name, g, r in zip(("y", "dx", "dw"), got, ref):
        check_budget(name, g, r, BUDGET[dw_budget if name == "dw" else name])


CASES = [
    # name, T, D, W, cu_seqlens, activation, weight dtype
    ("1-token and short docs, D not a block multiple", 37, 40, 4, [0, 5, 6, 37], "silu", torch.float32),
    ("empty docs, int64 cu, W=3", 29, 24, 3, [0, 0, 1, 3, 3, 29, 29], "silu", torch.float32),
    ("one doc (None), W=2, no act, bf16 w", 21, 16, 2, None, None, torch.bfloat16),
    ("docs crossing chunks, bf16 w", 35, 8, 4, [0, 2, 11, 12, 13, 35], "swish", torch.bfloat16),
    ("D % 8 != 0 (unaligned route)", 19, 20, 4, [0, 7, 19], "silu", torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_fp64_reference(case):
    name, T, D, W, cu, act, wdt = case
    x, w, dy = make(T, D, W, wdt)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64 if "int64" in name else torch.int32)
    y, dx, dw = run(x, w, dy, cu_t, act)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == wdt
    _check((y, dx, dw), causal_conv1d_ref_grads(x, w, dy, cu_t, act, round_preactivation=False),
           "dw32" if wdt == torch.float32 else "dw16")


def test_four_rows_per_step_configs(monkeypatch):
    """The kernels also run ROWS=4 (the shipped configs use 8): same results as the reference."""
    cfg = configs.CONFIGS["interpreter"]
    monkeypatch.setitem(configs.CONFIGS, "interpreter", dict(cfg, fwd=dict(cfg["fwd"], ROWS=4, CHUNK=4),
                                                          bwd=dict(cfg["bwd"], ROWS=4, CHUNK=8)))
    x, w, dy = make(23, 16, 4, seed=9)
    cu = torch.tensor([0, 3, 4, 13, 23], dtype=torch.int32)
    _check(run(x, w, dy, cu), causal_conv1d_ref_grads(x, w, dy, cu, "silu"))


def test_strided_and_misaligned_x():
    """x as a column slice of a wider projection: read in place (aligned) or copied (misaligned start)."""
    cu = torch.tensor([0, 3, 17, 30], dtype=torch.int32)
    for off in (8, 3):  # 8 columns: 16-byte aligned, stride 3*16; 3 columns: odd start, copied
        x, w, dy = make(30, 16, 4, x_cols=48, x_off=off, seed=off)
        assert x.stride() == (48, 1)
        _check(run(x, w, dy, cu), causal_conv1d_ref_grads(x, w, dy, cu, "silu"))


def test_tiny_and_empty():
    for T in (0, 1, 2):
        x, w, dy = make(T, 8, 4, seed=T)
        cu = torch.tensor([0, T], dtype=torch.int32)
        y, dx, dw = run(x, w, dy, cu)
        ry, rdx, rdw = causal_conv1d_ref_grads(x, w, dy, cu, "silu")
        assert y.shape == (T, 8) and dx.shape == (T, 8) and dw.shape == (8, 4)
        if T == 0:
            assert torch.equal(dw, torch.zeros_like(dw))
        else:
            assert rel_rms(y, ry) < BUDGET["y"] and rel_rms(dx, rdx) < BUDGET["dx"]
            assert rel_rms(dw, rdw) < BUDGET["dw32"]


def test_silu_grad_preactivation_option():
    """fp32: SiLU' at the exact pre-activation (dw matches the exact gradient to fp32 accuracy);
    bf16: at the pre-activation rounded to bf16 (visibly different dw)."""
    x, w, dy = make(40, 32, 4, seed=3)
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    _, _, rdw = causal_conv1d_ref_grads(x, w, dy, cu, "silu", round_preactivation=False)
    mek.configure(conv1d_silu_grad_preactivation="fp32")
    _, dx32, dw32 = run(x, w, dy, cu)
    mek.configure(conv1d_silu_grad_preactivation="bf16")
    _, dx16, dw16 = run(x, w, dy, cu)
    assert rel_rms(dw32, rdw) < 1e-6
    assert rel_rms(dw16, rdw) > 1e-5
    assert not torch.equal(dw16, dw32)


def test_backward_runs_the_forward_variant_and_option(monkeypatch):
    seen = []
    real = ops.CONV1D.backward

    def spy(dy, x, w, cu, h, act_mode, variant):
        seen.append((act_mode, variant))
        return real(dy, x, w, cu, h, act_mode, variant)

    monkeypatch.setattr(ops.CONV1D, "backward", spy)
    x, w, dy = make(12, 8, 4, seed=4)
    for fwd_cfg, bwd_cfg, want in (
            (dict(conv1d_variant="det"), dict(conv1d_variant="fast"), (1, "det")),
            (dict(conv1d_variant="fast", conv1d_silu_grad_preactivation="fp32"), dict(), (2, "fast"))):
        xr = x.detach().requires_grad_(True)
        wr = w.detach().requires_grad_(True)
        mek.configure(**fwd_cfg)
        y = conv1d.causal_conv1d(xr, wr)
        mek.configure(**bwd_cfg)
        y.backward(dy)
        assert seen[-1] == want


def test_eager_calls_skip_the_custom_ops_and_no_grad_skips_autograd(monkeypatch):
    """Eager calls run the launchers directly (a custom-op dispatch costs host time); a call with no input that
    needs a gradient runs the forward launcher alone. The custom ops exist for torch.compile under the uniform
    names."""
    assert torch.ops.miles_ext_kernels.conv1d_fwd.default is not None
    assert torch.ops.miles_ext_kernels.conv1d_bwd.default is not None
    x, w, dy = make(12, 8, 4, seed=8)
    want = run(x, w, dy, None)
    for name in ("forward_op", "backward_op"):
        monkeypatch.setattr(ops.CONV1D, name, lambda *a: pytest.fail("custom op dispatched in eager mode"))
    for p, q in zip(run(x, w, dy, None), want):
        assert torch.equal(p, q)
    y = conv1d.causal_conv1d(x, w)
    assert y.grad_fn is None and torch.equal(y, want[0])


def test_det_repeats_and_fast_agrees():
    x, w, dy = make(33, 24, 4, seed=5)
    cu = torch.tensor([0, 9, 10, 33], dtype=torch.int32)
    a = run(x, w, dy, cu)
    b = run(x, w, dy, cu)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    mek.configure(conv1d_variant="fast")
    f = run(x, w, dy, cu)
    for p, q in zip(f, a):  # fast runs the det kernels (fixed-order dw reduction measured faster than atomics)
        assert torch.equal(p, q)


@pytest.mark.parametrize("bad, exc, word", [
    (lambda x, w, cu: (x.float(), w, cu, "silu"), TypeError, "^x must be bfloat16"),
    (lambda x, w, cu: (x[None], w, cu, "silu"), ValueError, "^x must have 2 dimensions"),
    (lambda x, w, cu: (x.t(), w, cu, "silu"), ValueError, "^x must have a unit last stride"),
    (lambda x, w, cu: (x, w.half(), cu, "silu"), TypeError, "weight"),
    (lambda x, w, cu: (x, w[:, :1], cu, "silu"), ValueError, "weight"),
    (lambda x, w, cu: (x, torch.zeros(8, 5), cu, "silu"), ValueError, "weight"),
    (lambda x, w, cu: (x, w[:4], cu, "silu"), ValueError, "weight"),
    (lambda x, w, cu: (x, w, cu.float(), "silu"), TypeError, "cu_seqlens"),
    (lambda x, w, cu: (x, w, cu[None], "silu"), ValueError, "cu_seqlens"),
    (lambda x, w, cu: (x, w, cu, "gelu"), ValueError, "activation"),
    # meta stands in for another GPU on a CPU machine
    (lambda x, w, cu: (x, w.to("meta"), cu, "silu"), ValueError, "^weight must be on cpu, got meta"),
    (lambda x, w, cu: (x, w, cu.to("meta"), "silu"), ValueError, "^cu_seqlens must be on cpu, got meta"),
])
def test_bad_input_raises_before_launch(bad, exc, word, monkeypatch):
    monkeypatch.setattr(ops, "launch", lambda *a, **k: pytest.fail("launched"))
    x, w, _ = make(8, 8, 4)
    args = bad(x, w, torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(exc, match=word):
        conv1d.causal_conv1d(args[0], args[1], cu_seqlens=args[2], activation=args[3])


def test_rows_past_the_last_boundary_are_one_more_document():
    # padding after cu_seqlens[-1] (miles pads packs): its own document, in y, dx and dw alike
    x, w, dy = make(40, 16, 4, seed=9)
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    full = torch.tensor([0, 3, 12, 40], dtype=torch.int32)
    for p, q in zip(run(x, w, dy, cu), run(x, w, dy, full)):
        assert torch.equal(p, q)


def test_torch_compile_fullgraph_traces():
    x, w, dy = make(16, 8, 4, seed=6)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)

    def f(x, w, cu):
        return conv1d.causal_conv1d(x, w, cu_seqlens=cu) * 2

    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(xr, wr, cu)
    y.backward(dy)
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ye = f(xe, we, cu)
    ye.backward(dy)
    assert torch.equal(y, ye) and torch.equal(xr.grad, xe.grad) and torch.equal(wr.grad, we.grad)


def test_routes_declared(monkeypatch):
    """routes() runs the launchers on meta tensors over every flag and records their launches: per weight dtype
    3 W x 3 cu_seqlens (none, int32, int64) x 2 alignments x 2 (without / with an initial state) x (2 forward
    activations + 3 backward SiLU-grad modes) + 3 dw reductions (one per W), for the interpreter's table here and for
    the shipped sm_90a table."""
    from miles_ext_kernels.cake._runtime import build

    for arch in ("interpreter", "sm_90a"):
        if arch == "sm_90a":
            monkeypatch.setattr(build, "INTERPRET", False)
            monkeypatch.setattr(build, "device_arch", lambda *a: "sm_90a")
        for wd in ("float32", "bfloat16"):
            rs = routes(weight_dtype=wd)
            labels = [r.label for r in rs]
            assert len(labels) == len(set(labels)) == 3 * 3 * 2 * 2 * (2 + 3) + 3
            kinds = [lab.split("[")[0] for lab in labels]
            assert (kinds.count("conv1d_fwd_kernel"), kinds.count("conv1d_bwd_kernel"),
                    kinds.count("dw_reduce_kernel")) == (72, 108, 3)
            halo = [r for r in rs if r.args.get("HALO")]
            assert len(halo) == 90 and all(r.args["h_ptr"] == torch.bfloat16 for r in halo)
            assert all(r.args["dh_ptr"] == torch.bfloat16 for r in halo if "dh_ptr" in r.args)
            assert all(r.args["h_ptr"] is None for r in rs if "h_ptr" in r.args and not r.args["HALO"])
            table = {"conv1d_fwd_kernel": "fwd", "conv1d_bwd_kernel": "bwd", "dw_reduce_kernel": "red"}
            for r, kind in zip(rs, kinds):
                cfg = configs.CONFIGS[arch][table[kind]]
                assert all(r.args[k] == v for k, v in cfg.items())  # the table's constexprs and launch options
                assert r.args["w_ptr" if "w_ptr" in r.args else "dw_ptr"] == getattr(torch, wd)
    with pytest.raises(ValueError, match="weight_dtype"):
        routes(weight_dtype="float16")


def test_demo_cpu():
    rows = assert_demo_passes(conv1d.OP, "cpu")
    assert {r["tensor"] for r in rows} == {"y", "dx", "dw"}


def test_shift_reference_matches_conv1d_reference():
    """The cheap reference the GPU tests and benchmarks use equals the F.conv1d one (FP64)."""
    from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_shift
    x, w, dy = make(40, 12, 4, seed=7)
    for cu in (None, torch.tensor([0, 0, 1, 3, 3, 17, 40])):
        for act in ("silu", None):
            for rnd in (False, True):
                a = causal_conv1d_ref_grads(x, w, dy, cu, act, round_preactivation=rnd)
                b = causal_conv1d_ref_shift(x, w, dy, cu, act, round_preactivation=rnd)
                for p, q in zip(a, b):
                    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_torch_compile_before_the_implementation_is_imported():
    """The first call of an entry point may happen inside a dynamo trace: the declaration's lazy import must trace."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, torch
        from miles_ext_kernels.cake import conv1d
        assert "miles_ext_kernels.cake._impl.conv1d" not in sys.modules
        x = torch.randn(12, 8, dtype=torch.bfloat16)
        w = torch.randn(8, 4)
        f = torch.compile(lambda x, w: conv1d.causal_conv1d(x, w), fullgraph=True, backend="aot_eager")
        print(float(f(x, w).float().abs().sum()) > 0)
    """)
    env = dict(__import__("os").environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("True"), out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------- initial_state
# fla's [N, D, W] layout: initial_state[n, :, W - k] is the row k before document n's start; entry 0 is not read.
HALO_BUDGET = dict(BUDGET, dh=6e-3)  # dh: 2x the worst the interpreter measured here (2.8e-3)


def halo_docs(W):
    """Document lengths around the width (0, 1, W-2, W-1, W) and starts placed against the interpreter's token
    chunks (8 forward, 16 backward): one at 15 of 2 tokens, which continues past 16 (the programs at 16 seed their
    window from its initial state without owning its gradient) and is followed by a start at 17, inside the first
    backward program's lookahead (W >= 3); one of a single token at a chunk start (32). Three padding rows follow
    cu_seqlens[-1]."""
    lengths = [0, 1, W - 2, W - 1, W, 0]
    lengths.append(15 - sum(lengths))
    lengths += [2, 15, 1, 12]
    return lengths, 3


def make_halo(N, D, W, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(N, D, W, generator=g).to(dtype)


def run_halo(x, w, dy, cu, h, activation="silu"):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    h = h.detach().requires_grad_(True)
    y = conv1d.causal_conv1d(x, w, cu_seqlens=cu, activation=activation, initial_state=h)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, h.grad


def check_halo(got, ref, wdt=torch.float32):
    """(y, dx, dw, dh) against the reference's, each within its budget."""
    budgets = dict(HALO_BUDGET, dw=HALO_BUDGET["dw32" if wdt == torch.float32 else "dw16"])
    for name, a, r in zip(("y", "dx", "dw", "dh"), got, ref):
        check_budget(name, a, r, budgets[name])


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_initial_state_varlen_against_fp64_reference(W, activation):
    lengths, pad = halo_docs(W)
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    T = bounds[-1] + pad
    cu = torch.tensor(bounds, dtype=torch.int32)
    full = torch.tensor(bounds + [T])  # the padding rows as one more document, without an initial state
    x, w, dy = make(T, 40, W, seed=W)
    h = make_halo(len(lengths), 40, W, seed=W)
    got = run_halo(x, w, dy, cu, h, activation)
    ref = causal_conv1d_ref_grads(x, w, dy, full, activation, initial_state=h)
    assert got[3].dtype == torch.bfloat16 and got[3].shape == h.shape
    check_halo(got, ref)
    dh = got[3]
    assert torch.equal(dh[:, :, 0], torch.zeros_like(dh[:, :, 0]))  # entry 0 is not read
    for n, length in enumerate(lengths):
        if length == 0:  # an empty document reads nothing
            assert torch.equal(dh[n], torch.zeros_like(dh[n])), n
        else:  # its first row reads every entry 1..W-1, however short the document
            assert dh[n, :, 1:].all(), n


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("T", [1, 2, 3, 21])
def test_initial_state_one_document(W, T):
    """cu_seqlens=None: one document, N = 1, of T tokens below, at and past W-1 (bf16 weight)."""
    x, w, dy = make(T, 24, W, torch.bfloat16, seed=T)
    h = make_halo(1, 24, W, seed=T)
    got = run_halo(x, w, dy, None, h)
    ref = causal_conv1d_ref_grads(x, w, dy, None, "silu", initial_state=h)
    check_halo(got, ref, torch.bfloat16)
    assert torch.equal(got[3][:, :, 0], torch.zeros(1, 24, dtype=torch.bfloat16))


def test_initial_state_int64_cu_unaligned_d_and_strided():
    """int64 cu_seqlens, D % 8 != 0 (the unaligned route), x a column slice and a non-contiguous initial state
    (copied): the same results as the reference."""
    cu = torch.tensor([0, 2, 2, 19, 20, 30], dtype=torch.int64)
    x, w, dy = make(30, 20, 4, seed=3)
    h = make_halo(5, 20, 4, seed=3)
    got = run_halo(x, w, dy, cu, h.transpose(1, 2).contiguous().transpose(1, 2))
    ref = causal_conv1d_ref_grads(x, w, dy, cu, "silu", initial_state=h)
    check_halo(got, ref)
    xs, w, dy = make(30, 16, 4, seed=4, x_cols=48, x_off=8)
    h = make_halo(5, 16, 4, seed=4)
    check_halo(run_halo(xs, w, dy, cu, h), causal_conv1d_ref_grads(xs, w, dy, cu, "silu", initial_state=h))


def test_initial_state_four_rows_per_step_configs(monkeypatch):
    cfg = configs.CONFIGS["interpreter"]
    monkeypatch.setitem(configs.CONFIGS, "interpreter", dict(cfg, fwd=dict(cfg["fwd"], ROWS=4, CHUNK=4),
                                                          bwd=dict(cfg["bwd"], ROWS=4, CHUNK=4)))
    # CHUNK 4 > W-1 = 3 but the documents of 1 and 2 tokens put several starts inside one chunk and its lookahead
    cu = torch.tensor([0, 3, 4, 6, 13, 23], dtype=torch.int32)
    x, w, dy = make(23, 16, 4, seed=9)
    h = make_halo(5, 16, 4, seed=9)
    check_halo(run_halo(x, w, dy, cu, h), causal_conv1d_ref_grads(x, w, dy, cu, "silu", initial_state=h))


def test_initial_state_gradient_only_and_silu_option():
    """Only the initial state needs a gradient (x and weight do not); the fp32 SiLU-grad option gives dh at fp32
    accuracy before its bf16 rounding (same order of error as the bf16 option's)."""
    cu = torch.tensor([0, 1, 9, 30], dtype=torch.int32)
    x, w, dy = make(30, 16, 3, seed=11)
    h = make_halo(3, 16, 3, seed=11).requires_grad_(True)
    for opt in ("bf16", "fp32"):
        mek.configure(conv1d_silu_grad_preactivation=opt)
        y = conv1d.causal_conv1d(x, w, cu_seqlens=cu, initial_state=h)
        (dh,) = torch.autograd.grad(y, (h,), dy)
        ref = causal_conv1d_ref_grads(x, w, dy, cu, "silu", round_preactivation=opt == "bf16", initial_state=h)
        check_budget("dh", dh, ref[3], HALO_BUDGET["dh"])


def test_zero_initial_state_gives_the_bits_of_none():
    x, w, dy = make(33, 24, 4, seed=12)
    cu = torch.tensor([0, 1, 3, 17, 33], dtype=torch.int32)
    for c in (cu, None):
        h = torch.zeros(1 if c is None else 4, 24, 4, dtype=torch.bfloat16)
        with_h = run_halo(x, w, dy, c, h)
        without = run(x, w, dy, c)
        for p, q in zip(with_h[:3], without):
            assert torch.equal(p, q)


def test_split_document_with_its_halo_is_the_whole():
    """The context-parallel identity: a stream cut at token P, the second part given as initial state the last W-1
    rows before P of the document that continues, gives the whole's y bit for bit; the whole's dx on those rows is
    the first part's dx plus the initial state's gradient (within the budget), and dw the sum of both parts'."""
    W, D, T = 4, 24, 41
    cu = [0, 5, 30, 31, 41]
    x, w, dy = make(T, D, W, seed=13)
    whole = run(x, w, dy, torch.tensor(cu, dtype=torch.int32))
    for P in (8, 16, 17, 27):  # cuts inside document [5, 30), at and off the chunk starts
        cu1 = torch.tensor([c for c in cu if c < P] + [P], dtype=torch.int32)
        cu2 = torch.tensor([0] + [c - P for c in cu if c > P], dtype=torch.int32)
        h = torch.zeros(cu2.numel() - 1, D, W, dtype=torch.bfloat16)
        h[0, :, 1:] = x[P - W + 1:P].t()  # the continuing document's rows P-3, P-2, P-1
        a = run(x[:P], w, dy[:P], cu1)
        b = run_halo(x[P:], w, dy[P:], cu2, h)
        assert torch.equal(torch.cat([a[0], b[0]]), whole[0])
        dx = torch.cat([a[1].double(), b[1].double()])
        dx[P - W + 1:P] += b[3][0, :, 1:].t().double()
        ref = causal_conv1d_ref_grads(x, w, dy, torch.tensor(cu), "silu")
        check_budget("dx", dx, ref[1], BUDGET["dx"])
        check_budget("dw", a[2].double() + b[2].double(), ref[2], BUDGET["dw32"])


def test_initial_state_det_repeats_and_fast_agrees():
    x, w, dy = make(37, 40, 4, seed=14)
    cu = torch.tensor([0, 1, 2, 2, 16, 19, 37], dtype=torch.int32)
    h = make_halo(6, 40, 4, seed=14)
    first = run_halo(x, w, dy, cu, h)
    for p, q in zip(run_halo(x, w, dy, cu, h), first):
        assert torch.equal(p, q)
    mek.configure(conv1d_variant="fast")
    for p, q in zip(run_halo(x, w, dy, cu, h), first):
        assert torch.equal(p, q)


def test_initial_state_launches_halo_routes_only_when_given(monkeypatch):
    seen = []
    real = ops.launch

    def spy(kernel, grid, **kw):
        if "HALO" in kw:  # forward: h_ptr; backward: h_ptr and dh_ptr
            seen.append((kw["HALO"], *(kw[k] is None for k in ("h_ptr", "dh_ptr") if k in kw)))
        return real(kernel, grid, **kw)

    monkeypatch.setattr(ops, "launch", spy)
    x, w, dy = make(12, 8, 4, seed=15)
    run(x, w, dy, None)
    assert seen == [(False, True), (False, True, True)]
    seen.clear()
    run_halo(x, w, dy, None, make_halo(1, 8, 4))
    assert seen == [(True, False), (True, False, False)]


@pytest.mark.parametrize("bad, exc, word", [
    (lambda h: h.tolist(), TypeError, r"^initial_state must be a torch.Tensor"),
    (lambda h: h.float(), TypeError, r"^initial_state must be bfloat16, got float32"),
    (lambda h: h.half(), TypeError, r"^initial_state must be bfloat16"),
    (lambda h: h[0], ValueError, r"^initial_state must have 3 dimensions"),
    (lambda h: h[:, :, 1:], ValueError, r"^initial_state must be \[N, D, W\] = \[2, 8, 4\].*got \[2, 8, 3\]"),
    (lambda h: h[:1], ValueError, r"^initial_state must be \[N, D, W\] = \[2, 8, 4\]"),
    (lambda h: torch.cat([h, h]), ValueError, r"^initial_state must be \[N, D, W\]"),
    (lambda h: h[:, :4], ValueError, r"^initial_state must be \[N, D, W\]"),
    (lambda h: h.to("meta"), ValueError, r"^initial_state must be on cpu, got meta"),
])
def test_initial_state_bad_input_raises_before_launch(bad, exc, word, monkeypatch):
    monkeypatch.setattr(ops, "launch", lambda *a, **k: pytest.fail("launched"))
    x, w, _ = make(8, 8, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(exc, match=word):
        conv1d.causal_conv1d(x, w, cu_seqlens=cu, initial_state=bad(make_halo(2, 8, 4)))
    with pytest.raises(ValueError, match=r"^initial_state must be \[N, D, W\] = \[1, 8, 4\] \(N: the documents"):
        conv1d.causal_conv1d(x, w, initial_state=make_halo(2, 8, 4))  # without cu_seqlens N is 1


def test_initial_state_torch_compile_fullgraph_traces():
    x, w, dy = make(16, 8, 4, seed=16)
    cu = torch.tensor([0, 2, 16], dtype=torch.int32)
    h = make_halo(2, 8, 4, seed=16)

    def f(x, w, cu, h):
        return conv1d.causal_conv1d(x, w, cu_seqlens=cu, initial_state=h) * 2

    leaves = [t.clone().requires_grad_(True) for t in (x, w, h)]
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(leaves[0], leaves[1], cu, leaves[2])
    got = torch.autograd.grad(y, leaves, dy)
    eager = [t.clone().requires_grad_(True) for t in (x, w, h)]
    ye = f(eager[0], eager[1], cu, eager[2])
    want = torch.autograd.grad(ye, eager, dy)
    assert torch.equal(y, ye) and all(torch.equal(p, q) for p, q in zip(got, want))


def test_shift_reference_with_initial_state_matches_conv1d_reference():
    from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_shift
    x, w, dy = make(40, 12, 4, seed=17)
    for W in (2, 3, 4):
        for cu in (None, torch.tensor([0, 0, 1, 3, 3, 17, 38, 40])):
            h = make_halo(1 if cu is None else 7, 12, W, seed=W)
            for act in ("silu", None):
                a = causal_conv1d_ref_grads(x, w[:, :W], dy, cu, act, initial_state=h)
                b = causal_conv1d_ref_shift(x, w[:, :W], dy, cu, act, initial_state=h)
                assert len(a) == len(b) == 4
                for p, q in zip(a, b):
                    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_initial_state_gradient_has_one_writer(monkeypatch):
    """The results do not depend on the order the programs run in (on a GPU they run concurrently): run in reverse
    order, they give the same bits. A program that stored a dh entry of a document it does not own (one that began
    in an earlier chunk: its partial sums lack that chunk's rows) would be seen here whichever of the two stores
    the interpreter, running programs one after another, happens to do last."""
    from triton.runtime import interpreter

    x, w, dy = make(48, 40, 4, seed=18)
    cu = torch.tensor([0, 15, 17, 18, 32, 33, 45], dtype=torch.int32)  # starts at and just past chunk ends
    h = make_halo(6, 40, 4, seed=18)
    first = run_halo(x, w, dy, cu, h)
    b = interpreter.interpreter_builder
    forward = b.set_grid_idx
    monkeypatch.setattr(b, "set_grid_idx", lambda x, y, z: forward(*(n - 1 - i for n, i in zip(b.grid_dim, (x, y, z)))))
    for p, q in zip(run_halo(x, w, dy, cu, h), first):
        assert torch.equal(p, q)
