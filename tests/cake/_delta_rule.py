"""Checks that the two delta-rule ops' tests (tests/cake/gdn, tests/cake/kda) make the same way: on CPU (the
interpreter) and on the GPU."""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import torch
import torch.utils.checkpoint

import miles_ext_kernels as mek
from miles_ext_kernels.cake._runtime.testing import check_budget, rel_rms
from tests._paths import ROOT
from tests.cake._helpers import assert_nonfinite_as_in_reference

FWD = ("o", "ht")
QKVGB = ("q", "k", "v", "g", "beta")


def assert_nonfinite_as_in_demo_reference(op: str, inp: dict, name: str, value: float, tokens) -> None:
    """assert_nonfinite_as_in_reference for `op` ("gdn" or "kda") on its demo's inputs `inp`: an initial state, the
    final state, L2 norm in the kernel, cu_seqlens (kda: the gate and state layout `inp` was made with)."""
    reference = importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.reference")
    if op == "gdn":
        from miles_ext_kernels.cake.gdn import chunk_gated_delta_rule as call
        ref_call = reference.gdn_reference

        def kwargs(x):
            return dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    else:
        from miles_ext_kernels.cake.kda import chunk_kda as call
        demo = importlib.import_module("miles_ext_kernels.cake._impl.kda.demo")
        ref_call = reference.kda_reference

        def kwargs(x):
            return dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **demo._kwargs(x, True, True, True))

    def run(x):
        return call(*(x[n] for n in QKVGB), initial_state=x["h0"], **kwargs(x))

    def ref(x):
        return ref_call(*(x[n].double() for n in QKVGB), initial_state=x["h0"].double(), **kwargs(x))

    assert_nonfinite_as_in_reference(run, ref, inp, name, value, tokens)


def _per_name_error(name, got, ref):
    return rel_rms(got, ref[name])


def _per_name_check(name, got, ref, budget):
    return check_budget(name, got, ref[name], budget)


def check_against_fp64_and_peer(tag: str, ours: dict, ref: dict, peer, budgets: dict, error=_per_name_error,
                                check=_per_name_check, tied=FWD) -> None:
    """Prints `tag` and, per tensor, our error, the peer's (fla's; NaN without one), our result x 1.02's and the
    budget (JSON); then each tensor of `ours` must be within its budget, each tensor named in `tied` (default o and
    ht) within 1.1 x the peer's error too where a peer ran. `error(name, got, ref)` and `check(name, got, ref,
    budget)` take the whole reference dict (default: the relative RMS against ref[name], check_budget)."""
    rows = {}
    for name in ours:
        rows[name] = dict(ours=error(name, ours[name], ref),
                          fla=error(name, peer[name], ref) if peer is not None else float("nan"),
                          ours_x102=error(name, ours[name].double() * 1.02, ref), budget=budgets[name])
    print(f"\n{tag} " + json.dumps(rows))
    for name in ours:
        budget = budgets[name]
        if peer is not None and name in tied:
            budget = min(budget, 1.1 * rows[name]["fla"])
        check(name, ours[name], ref, budget)


def assert_det_bits_again_fast_side_stream_pool(run, ours: dict, fast: dict) -> None:
    """`run()` (a dict of tensors) again; then under `mek.configure(**fast)` (the fast variant and a workspace pool),
    and twice on a side stream (pooled buffers reused): every tensor has the bits of `ours` each time."""
    again = run()
    mek.configure(**fast)
    fast_out = run()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = run()
        side_again = run()  # pooled buffers reused
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    mek.configure()
    for name in ours:
        for other in (again, fast_out, side, side_again):
            assert torch.equal(ours[name], other[name]), name


def wide_views(call, names, pad: int):
    """`call` with its positional operands `names` (of q, k, v, g, beta) passed as views of wider projections: each
    [B, T, A, D] operand becomes the first A * D columns of [B, T, A * D + pad] rows (a cat, so gradients reach the
    originals), heads packed within a token, token stride A * D + pad."""
    def run(*args, **kw):
        args = list(args)
        for name in names:
            i = QKVGB.index(name)
            x = args[i]
            B, T, A, D = x.shape
            rows = torch.cat([x.reshape(B, T, A * D), torch.randn(B, T, pad, device=x.device).to(x.dtype)], -1)
            args[i] = rows[..., :A * D].view(B, T, A, D)
            assert args[i].stride(1) == A * D + pad and not args[i].is_contiguous()
        return call(*args, **kw)
    return run


def assert_views_read_in_place(op: str, run_impl, inp: dict, call, names, l2: bool, in_place: set,
                               pad: int = 16) -> None:
    """Operands `names` as views of wider projections (`wide_views`, rows `pad` elements wider) give the bits of
    contiguous ones for o, the final state and every gradient; those in `in_place` are read without a copy (the
    others copied once in the forward and once in the backward)."""
    from miles_ext_kernels.cake._runtime.operands import COPIES

    plain = run_impl(inp, l2=l2)
    before = {n: COPIES[(op, n)] for n in names}
    viewed = run_impl(inp, l2=l2, impl=wide_views(call, names, pad))
    copied = {n for n in names if COPIES[(op, n)] != before[n]}
    assert copied == set(names) - in_place, copied
    for n in plain:
        assert torch.equal(plain[n], viewed[n]), n


def checkpointed(fn):
    """`fn` under torch.utils.checkpoint (its forward run again in the backward), as a demo run_impl's `impl`."""
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


def assert_checkpoint_graph_compile_same_bits(run, fn, ours: dict) -> None:
    """`run(impl)` (the op's demo run_impl on fixed inputs: a dict of the outputs and gradients, `impl` taking the
    op's arguments) under activation checkpointing (the forward recomputed in the backward), as a CUDA graph of
    forward + backward (captured after a warm-up on the capture stream; its outputs poisoned, then replayed) and
    through torch.compile(fullgraph=True) with the default backend: every tensor has the bits of `ours`, the eager
    call's. `fn`: the op's public function."""
    for tag, got in (("checkpoint", run(checkpointed(fn))), ("torch.compile", run(torch.compile(fn, fullgraph=True)))):
        assert set(got) == set(ours), tag
        for n in ours:
            assert torch.equal(ours[n], got[n]), f"{tag}: {n}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(None)
    for t in captured.values():
        t.fill_(float("nan"))  # poisoned: the replay must write every element
    graph.replay()
    torch.cuda.synchronize()
    assert set(captured) == set(ours)
    for n in ours:
        assert torch.equal(ours[n], captured[n]), f"graph replay: {n}"



def assert_state_tiles_same_bits(run, configs, monkeypatch) -> None:
    """`run()` (a dict of tensors) with every sequential state kernel on its wide tiles and again on its narrow
    ones (`configs`: the op's configs module; the choice between them follows the number of documents x heads, so a
    document's bits are independent of what is packed beside it only if the two agree): every tensor equal."""
    monkeypatch.setattr(configs, "NARROW_BELOW", 0)
    wide = run()
    monkeypatch.setattr(configs, "NARROW_BELOW", 1 << 30)
    narrow = run()
    for name in wide:
        assert torch.equal(wide[name], narrow[name]), name

def assert_fresh_process_same_bits(op: str, ours: dict, tmp_path, make_inputs_args: str, l2: bool) -> None:
    """A fresh interpreter at the repository root runs `op`'s demo `run_impl(make_inputs(<make_inputs_args>),
    l2=l2)`: every tensor has the bits of `ours`."""
    path = str(tmp_path / "bits.pt")
    script = textwrap.dedent(f"""
        import importlib, torch
        d = importlib.import_module("miles_ext_kernels.cake._impl.{op}.demo")
        inp = d.make_inputs({make_inputs_args})
        torch.save({{n: t.cpu() for n, t in d.run_impl(inp, l2={l2}).items()}}, {path!r})
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    there = torch.load(path)
    for name in ours:
        assert torch.equal(ours[name].cpu(), there[name]), name


def assert_no_host_sync(step) -> None:
    """`step()` (a forward and backward) on the GPU asks for no host sync."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def run_batch_without_cu_seqlens(call, reference, K: int, V: int, g_tail=(), g_shift=0.0):
    """B = 2 sequences of T = 300 tokens, 4 heads, no cu_seqlens, initial or final state, no L2 norm in the kernel (q,
    k normalized before), seed 5, on the GPU: (ours, FP64 reference) dicts of o and the gradients dq, dk, dv, dg,
    dbeta. `call`, `reference`: the op and its FP64 recurrence; g: logsigmoid(N(0, 1) + g_shift), [B, T, 4, *g_tail]."""
    gen = torch.Generator().manual_seed(5)
    B, T, Hh = 2, 300, 4
    q = torch.nn.functional.normalize(torch.randn(B, T, Hh, K, generator=gen), dim=-1).to(torch.bfloat16).cuda()
    k = torch.nn.functional.normalize(torch.randn(B, T, Hh, K, generator=gen), dim=-1).to(torch.bfloat16).cuda()
    v = torch.randn(B, T, Hh, V, generator=gen).to(torch.bfloat16).cuda()
    g = torch.randn(B, T, Hh, *g_tail, generator=gen)
    if g_shift:
        g = g + g_shift
    g = torch.nn.functional.logsigmoid(g).cuda()
    beta = torch.rand(B, T, Hh, generator=gen).cuda()
    do = torch.randn(B, T, Hh, V, generator=gen).to(torch.bfloat16).cuda()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, ht = call(*leaves)
    assert ht is None
    o.backward(do)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, g, beta)]
    ro, _ = reference(*ref_leaves)
    ro.backward(do.double())
    names = ("dq", "dk", "dv", "dg", "dbeta")
    got = {"o": o.detach(), **{n: a.grad for n, a in zip(names, leaves)}}
    ref = {"o": ro.detach(), **{n: b.grad for n, b in zip(names, ref_leaves)}}
    return got, ref
