"""Step benchmark: a Qwen3-Next-shaped layer stack (one full-attention layer, then one Gated-DeltaNet layer),
forward + backward, per stack eager and captured once in one CUDA graph, in one run.

Layers (hidden 2048, bf16 weights, no biases; 32768 packed tokens: 16 documents of 2048, --docs irregular: the 12
irregular documents of bench/model.py), each `x + f(norm(x))`:
- full attention: zero-centred RMSNorm -> q|gate, k, v projections -> causal GQA over the documents (Hq 16 / Hkv 2,
  head dim 256) -> o * sigmoid(gate) (Qwen3-Next's gated attention) -> o projection. No RoPE and no q/k norms.
- Gated DeltaNet: zero-centred RMSNorm -> in-projections qkv, z, b|a (Qwen3.5's split layout) -> causal conv
  (width 4, SiLU) over the q|k|v channels in [T, D] -> chunked gated delta rule (H 16 key / HV 32 value heads,
  K = V = 128, L2 norm of q, k in the kernel, value head hv reads key head hv // (HV / H), beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias) in fp32, as HF's Qwen3-Next) -> gated RMSNorm per head with z -> out
  projection.
Stacks, from the same weights and inputs (the projections are torch's bf16 matmuls in every stack):
- cake det: our zero_centered_rmsnorm, varlen_gqa_attention, causal_conv1d, chunk_gated_delta_rule and
  rmsnorm_silu_gate, every op configured det.
- peers: fla's chunk_gated_delta_rule, causal_conv1d (backend "triton") and rms_norm_gated (FusedRMSNormGated's
  function), Liger's RMSNorm (offset 1.0, casting mode "gemma"), and flash_attn's flash_attn_varlen_func where it
  imports, else torch's own FlashAttention-2 varlen aten ops (bench/gqa.py's "FA2 varlen" peer), else torch SDPA
  (causal; dense [B, H, L, D] when every document has the same length, else each document padded to the longest).
  Labelled by what ran; skipped, with the reason printed, where fla or Liger do not import.
Runs per stack: eager (one forward + torch.autograd.grad of the output w.r.t. the input and every weight, with a
fixed output gradient) and graph (that step captured once in a CUDA graph after a warm-up on a side stream, static
inputs and gradients, replayed). A stack that fails to capture is recorded with the message (a failure of ours
makes the exit status 1). Times: `median_ms` (synced: one sync per step, the host's launch path included) and
`device_ms` (the host's launch work hidden behind a GPU spin); tokens/s from the synced time; peak memory
(max_memory_allocated over one step, or over capture + one replay; weights and inputs included). det: ours repeats
the output and every gradient bit for bit (eager: two steps; graph: two replays, and the replay against eager).
Accuracy: relative RMS of each peer's output and gradients against ours (eager). Writes bench/results/step.json in
the harness's layout (one row per stack and run, mode "full"; _common.py).

    python bench/step.py [--docs regular|irregular] [--runs eager,graph] [--no-peers] [--rep N] [--dry-run]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.metadata
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    FORMAT,
    TIMER_DOC,
    AtenFA2Varlen,
    _dry_ms,
    configured,
    device_ms,
    has_aten_fa2,
    median_ms,
    print_table,
    rel_rms,
    write_results,
)
from model import doc_lengths  # noqa: E402 - the same 12 irregular documents as the model benchmark

BF = torch.bfloat16
EPS = 1e-6  # Qwen3-Next's rms_norm_eps
RUNS = ("eager", "graph")
PEERS = "peers (fla + Liger + FA2-varlen or SDPA)"  # the peer stack's name where it does not build
DET = {f"{op}_variant": "det" for op in ("rmsnorm", "gqa", "conv1d", "gdn", "gated_rmsnorm")}


class Skip(Exception):
    """A stack or run that does not run here (the message says why)."""


@dataclass(frozen=True)
class Dims:
    """The layer shapes: attention heads hq / hkv at head dim d; GDN key heads h x k, value heads hv x v."""
    hidden: int = 2048
    hq: int = 16
    hkv: int = 2
    d: int = 256
    h: int = 16
    hv: int = 32
    k: int = 128
    v: int = 128
    width: int = 4

    @property
    def conv_dim(self) -> int:
        """The channels the conv runs over: q | k | v."""
        return 2 * self.h * self.k + self.hv * self.v


FULL = Dims()
# CPU dry run: hidden 64 (rmsnorm's smallest width); gqa serves head dim 256 only; the gated norm serves head dims
# 64 / 128 / 256, so V = 64 (gdn serves 16..128), K = 32; GVA kept (HV = 2 H).
DRY = Dims(hidden=64, hq=2, hkv=1, h=1, hv=2, k=32, v=64)
DRY_LENS = {"regular": [8, 8, 8], "irregular": [9, 14, 5]}


# ---------------------------------------------------------------------------------------------------- inputs
@dataclass
class Docs:
    """Where the documents lie in the T packed tokens: host lengths, cu_seqlens int32 / int64 [N + 1], the longest,
    and `pad_index` int64 [T]: each token's row in the [N * longest] padded layout (the padded SDPA peer)."""
    lens: list
    cu32: torch.Tensor
    cu64: torch.Tensor
    max_len: int
    pad_index: torch.Tensor

    @classmethod
    def make(cls, lens, device):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
        longest = max(lens)
        pad = torch.cat([n * longest + torch.arange(length) for n, length in enumerate(lens)])
        return cls(list(lens), cu.to(device, torch.int32), cu.to(device), longest, pad.to(device))

    @property
    def equal(self) -> bool:
        return len(set(self.lens)) == 1


def make_weights(dims: Dims, device, seed=0) -> dict:
    """The weights every stack shares (bf16 leaves, as a bf16 model's), drawn on the CPU from one seed. Projections
    are F.linear weights [out, in], scaled 1 / sqrt(in). q_proj's rows are [query | gate] (HF interleaves them per
    head; one block each keeps the query heads of a token contiguous, the layout our attention reads in place)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    def linear(n_out, n_in):
        return rand(n_out, n_in, scale=n_in ** -0.5)

    d = dims
    w = {
        "attn_norm": rand(d.hidden, scale=0.1),  # zero-centred: the scale is 1 + w
        "q_proj": linear(2 * d.hq * d.d, d.hidden),
        "k_proj": linear(d.hkv * d.d, d.hidden),
        "v_proj": linear(d.hkv * d.d, d.hidden),
        "o_proj": linear(d.hidden, d.hq * d.d),
        "gdn_norm": rand(d.hidden, scale=0.1),
        "in_proj_qkv": linear(d.conv_dim, d.hidden),
        "in_proj_z": linear(d.hv * d.v, d.hidden),
        "in_proj_ba": linear(2 * d.hv, d.hidden),
        "conv": rand(d.conv_dim, d.width, scale=d.width ** -0.5),  # [D, W], conv1d's layout
        "A_log": torch.empty(d.hv).uniform_(1, 16, generator=g).log(),  # HF's init
        "dt_bias": torch.ones(d.hv),
        "out_norm": 1 + rand(d.v, scale=0.1),  # the gated norm's weight is not zero-centred
        "out_proj": linear(d.hidden, d.hv * d.v),
    }
    return {n: t.to(device=device, dtype=BF).requires_grad_() for n, t in w.items()}


def make_inputs(dims: Dims, tokens: int, device, seed=1):
    """(x [T, hidden] bf16 leaf: the residual stream entering the stack, dy [T, hidden] bf16: the fixed gradient of
    the stack's output)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dims.hidden, generator=g).to(device=device, dtype=BF).requires_grad_()
    dy = torch.randn(tokens, dims.hidden, generator=g).to(device=device, dtype=BF)
    return x, dy


# ---------------------------------------------------------------------------------------------------- stacks
@dataclass
class Ops:
    """One stack's implementations of the five ops the layers call:
    norm(x [T, hidden], w [hidden]) -> [T, hidden]                                  zero-centred RMSNorm
    attention(q [T, Hq, D], k, v [T, Hkv, D], docs) -> [T, Hq, D]                   causal within documents
    conv(x [T, C], w [C, W], docs) -> [T, C]                                        causal depthwise conv + SiLU
    gdn(q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV], docs) -> [1, T, HV, V]   L2 norm of q, k inside
    gated_norm(x, z [T, HV, V], w [V]) -> [T, HV, V]                                RMSNorm(x) * w * silu(z)
    `config`: miles_ext_kernels.configure(**config) while the stack is built, run and captured."""
    label: str
    norm: Callable
    attention: Callable
    conv: Callable
    gdn: Callable
    gated_norm: Callable
    config: dict = field(default_factory=dict)
    ours: bool = False


def ours_ops(dims: Dims, device) -> Ops:
    from miles_ext_kernels.cake import conv1d, gated_rmsnorm, gdn, gqa, rmsnorm

    def attention(q, k, v, docs):
        return gqa.varlen_gqa_attention(q, k, v, docs.cu32, docs.cu32, max_seqlen_k=docs.max_len,
                                        softmax_scale=dims.d ** -0.5)

    def gdn_core(q, k, v, g, beta, docs):
        return gdn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=docs.cu32)[0]

    return Ops("cake det", norm=lambda x, w: rmsnorm.zero_centered_rmsnorm(x, w, EPS), attention=attention,
               conv=lambda x, w, docs: conv1d.causal_conv1d(x, w, cu_seqlens=docs.cu32, activation="silu"),
               gdn=gdn_core, gated_norm=lambda x, z, w: gated_rmsnorm.rmsnorm_silu_gate(x, z, w, EPS),
               config=DET, ours=True)


def _need(module: str):
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a peer that does not import is skipped, whatever the reason
        raise Skip(f"{module} does not import: {e!r}"[:300]) from None


def _version(dist: str, module: str) -> str:
    """The installed version of a peer, for its label: the distribution's, else the module's __version__."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get(module), "__version__", "?"))


def sdpa_attention(dims: Dims):
    """torch SDPA, causal: documents of one length as a dense [B, H, L, D] batch, else each document padded to the
    longest (right padding: a real query sees only real keys; padded queries are dropped, so they get no
    gradient). The backend is torch's choice (FlashAttention-2 where it serves head dim 256 with GQA)."""
    scale = dims.d ** -0.5

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def attention(q, k, v, docs):
        n, longest = len(docs.lens), docs.max_len
        if docs.equal:  # [T, H, D] -> [B, H, L, D] views
            out = sdpa(*(t.view(n, longest, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)))
            return out.transpose(1, 2).reshape(q.shape)

        def pad(t):
            rows = t.new_zeros(n * longest, t.shape[1], t.shape[2]).index_copy(0, docs.pad_index, t)
            return rows.view(n, longest, t.shape[1], t.shape[2]).transpose(1, 2)
        out = sdpa(pad(q), pad(k), pad(v)).transpose(1, 2).reshape(n * longest, q.shape[1], q.shape[2])
        return out.index_select(0, docs.pad_index)

    return attention


def fa2_attention(dims: Dims):
    from flash_attn import flash_attn_varlen_func

    def attention(q, k, v, docs):
        return flash_attn_varlen_func(q, k, v, docs.cu32, docs.cu32, docs.max_len, docs.max_len,
                                      softmax_scale=dims.d ** -0.5, causal=True)
    return attention


def aten_fa2_attention(dims: Dims):
    if not has_aten_fa2():
        raise RuntimeError("this torch has no aten._flash_attention_forward")

    def attention(q, k, v, docs):
        return AtenFA2Varlen.apply(q, k, v, docs.cu32, docs.max_len, dims.d ** -0.5)
    return attention


def peer_ops(dims: Dims, device) -> Ops:
    """fla (GDN core, conv, gated norm) + Liger (RMSNorm) + FA2-varlen or SDPA (attention); Skip where fla or
    Liger do not import. Attention: flash_attn's varlen function, else torch's own FA2 varlen aten ops, else SDPA."""
    if not str(device).startswith("cuda"):
        raise Skip("needs a CUDA GPU")
    _need("fla")
    chunk_o = _need("fla.ops.common.chunk_o")
    fla_gdn = _need("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    fla_conv = _need("fla.modules.causal_conv1d").causal_conv1d
    try:
        fla_gated = importlib.import_module("fla.modules.norm.fused_norm_gate").rms_norm_gated
    except Exception:  # noqa: BLE001 - an fla with the older module layout
        fla_gated = _need("fla.modules.fused_norm_gate").rms_norm_gated
    liger = _need("liger_kernel.ops.rms_norm").LigerRMSNormFunction
    # fla refuses triton 3.4 - 3.7.0 on Hopper for its gated backward (a codegen bug): lifted, as bench/gdn.py does
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        attention, attn_label = fa2_attention(dims), f"FA2-varlen {_version('flash-attn', 'flash_attn')}"
    except Exception as e:  # noqa: BLE001 - the GPU machine of record has no flash_attn build
        try:
            attention, attn_label = aten_fa2_attention(dims), f"FA2-varlen (torch {torch.__version__} aten)"
            print(f"  peers: flash_attn does not import ({e!r}"[:200] + "); attention through torch's FA2 varlen",
                  flush=True)
        except Exception as e2:  # noqa: BLE001
            print(f"  peers: no FA2 varlen ({e2!r}"[:200] + "); attention through torch SDPA", flush=True)
            attention, attn_label = sdpa_attention(dims), "SDPA"

    def gdn_core(q, k, v, g, beta, docs):
        return fla_gdn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=docs.cu64)[0]

    def conv(x, w, docs):
        return fla_conv(x[None], w, activation="silu", backend="triton", cu_seqlens=docs.cu64)[0][0]

    def gated_norm(x, z, w):  # fla normalises rows of one head: [T * HV, V]
        v = x.shape[-1]
        return fla_gated(x.reshape(-1, v), z.reshape(-1, v), w, None, "swish", eps=EPS).view(x.shape)

    fla_v, liger_v = _version("flash-linear-attention", "fla"), _version("liger-kernel", "liger_kernel")
    label = f"fla {fla_v} + Liger {liger_v} + {attn_label}"
    return Ops(label, norm=lambda x, w: liger.apply(x, w, EPS, 1.0, "gemma", False, None), attention=attention,
               conv=conv, gdn=gdn_core, gated_norm=gated_norm)


def attn_label_for(ops: Ops, docs: Docs) -> str:
    """SDPA's label says which layout ran (dense or padded), which depends on the documents."""
    if ops.label.endswith("+ SDPA"):
        return ops.label + (" (dense)" if docs.equal else " (padded)")
    return ops.label


# ---------------------------------------------------------------------------------------------------- layers
def attention_layer(x, w, ops: Ops, docs: Docs, d: Dims):
    """x [T, hidden] -> x + o_proj(attention(q, k, v) * sigmoid(gate)) [T, hidden], q | gate, k, v from norm(x)."""
    T = x.shape[0]
    h = ops.norm(x, w["attn_norm"])
    qg = F.linear(h, w["q_proj"])  # [T, 2 Hq D]: query | gate
    q = qg[:, :d.hq * d.d].view(T, d.hq, d.d)  # a view: token stride 2 Hq D, heads contiguous
    gate = qg[:, d.hq * d.d:]
    k = F.linear(h, w["k_proj"]).view(T, d.hkv, d.d)
    v = F.linear(h, w["v_proj"]).view(T, d.hkv, d.d)
    o = ops.attention(q, k, v, docs).reshape(T, d.hq * d.d)
    return x + F.linear(o * torch.sigmoid(gate), w["o_proj"])


def gdn_layer(x, w, ops: Ops, docs: Docs, d: Dims):
    """x [T, hidden] -> x + out_proj(gated_norm(gdn(conv(qkv)), z)) [T, hidden], HF's Qwen3-Next decay math."""
    T = x.shape[0]
    h = ops.norm(x, w["gdn_norm"])
    mixed = F.linear(h, w["in_proj_qkv"])  # [T, 2 H K + HV V], contiguous: every conv reads it in place
    z = F.linear(h, w["in_proj_z"]).view(T, d.hv, d.v)
    ba = F.linear(h, w["in_proj_ba"])  # [T, 2 HV]: b | a
    y = ops.conv(mixed, w["conv"], docs)
    kd = d.h * d.k
    q = y[:, :kd].view(1, T, d.h, d.k)
    k = y[:, kd:2 * kd].view(1, T, d.h, d.k)
    v = y[:, 2 * kd:].view(1, T, d.hv, d.v)  # GVA native: no key head is repeated
    beta = ba[:, :d.hv].sigmoid()[None]
    # fp32, as HF computes it (A = -exp(A_log) would lose its low bits in bf16)
    g = (-w["A_log"].float().exp() * F.softplus(ba[:, d.hv:].float() + w["dt_bias"].float()))[None]
    o = ops.gated_norm(ops.gdn(q, k, v, g, beta, docs)[0], z, w["out_norm"])  # [T, HV, V]
    return x + F.linear(o.reshape(T, d.hv * d.v), w["out_proj"])


def make_step(ops: Ops, w: dict, x, dy, docs: Docs, d: Dims):
    """step() -> (out [T, hidden], dx, d<weight> for every weight in w's order): one forward of both layers and
    torch.autograd.grad with the fixed output gradient dy (grads are returned, not accumulated: a captured step
    writes them to its static outputs, and stacks sharing the weight leaves do not see each other's)."""
    leaves = [x, *w.values()]

    def step():
        out = gdn_layer(attention_layer(x, w, ops, docs, d), w, ops, docs, d)
        return (out.detach(), *torch.autograd.grad(out, leaves, dy))
    return step


def result_names(w: dict) -> list:
    return ["out", "dx"] + [f"d{n}" for n in w]


# ---------------------------------------------------------------------------------------------------- runs
def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def peak_gb(fn, device):
    """max_memory_allocated (GB) over one call of fn (allocations live before it included); None off CUDA."""
    if not str(device).startswith("cuda"):
        return None  # (a dry run on CPU: nothing to measure, and each interpreted step is slow)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def times(fn, args) -> dict:
    """{"synced_ms", "device_ms"} of fn(); a dry run: one call's wall time in both (not a measurement)."""
    if args.dry_run:
        ms = _dry_ms(fn, args.device)
        return {"synced_ms": ms, "device_ms": ms}
    return {"synced_ms": median_ms(fn, warmup=args.warmup, rep=args.rep),
            "device_ms": device_ms(fn, warmup=args.warmup, rep=args.rep, lead_ms=args.lead_ms)}


def run_eager(step, args):
    """(row fields, the step's result) of eager steps; det: a second step repeats the first bit for bit."""
    if not args.dry_run:
        step()  # first call: compiles / autotunes (outside the peak: fla's autotuner allocates its own copies)
    peak = peak_gb(step, args.device)
    row = {**times(step, args), "peak_gb": peak}
    first = step()
    row["bits_repeat"] = same_bits(first, step())
    return row, first


def warm_up(step, n=3):
    """n steps on a side stream before a capture (compiles, autotuning, lazy state), as torch.cuda.graphs asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(step):
    """(graph, static outputs) of `step` captured once (after `warm_up`)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def _capture_message(e: BaseException) -> str:
    """A failed capture often raises twice (the call that broke the capture, then capture_end): both messages."""
    msg = f"{type(e).__name__}: {e}"
    if e.__context__ is not None and e.__context__ is not e:
        msg += f" (after {type(e.__context__).__name__}: {e.__context__})"
    return " ".join(msg.split())[:400]


def run_graph(step, args, eager_result):
    """Row fields of replays of the captured step; det: two replays repeat, and the replay equals eager's bits.
    Raises Skip off CUDA; a capture that fails raises RuntimeError with its message."""
    if not str(args.device).startswith("cuda"):
        raise Skip("CUDA graphs need a CUDA GPU")
    warm_up(step)  # eager steps: a failure here is the stack's, not the capture's
    try:
        torch.cuda.reset_peak_memory_stats()  # the peak of the capture and a replay, not of the eager warm-up
        graph, static = capture(step)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported, not crashed
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        raise RuntimeError(f"capture failed: {_capture_message(e)}") from None
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    row = {**times(graph.replay, args), "peak_gb": peak}
    graph.replay()
    first = [t.clone() for t in static]
    graph.replay()
    torch.cuda.synchronize()
    row["bits_repeat"] = same_bits(first, static)
    row["bits_vs_eager"] = same_bits(first, eager_result) if eager_result is not None else None
    del graph, static
    return row


def _free(device):
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- main
class Report:
    """Rows (harness layout), accuracy, skips and failures of one run."""

    def __init__(self, shape, tokens):
        self.shape, self.tokens = shape, tokens
        self.rows, self.accuracy, self.skipped, self.failures = [], [], [], []

    def skip(self, stack, run, reason):
        print(f"skip {stack} / {run}: {reason}", flush=True)
        self.skipped.append({"op": "step", "shape": self.shape, "provider": stack, "run": run, "reason": reason})

    def fail(self, stack, run, err, ours):
        reason = f"{type(err).__name__}: {err}"[:400]
        print(f"FAILED {stack} / {run}: {reason}", flush=True)
        self.failures.append({"op": "step", "shape": self.shape, "provider": stack, "run": run, "reason": reason,
                              "ours": ours})

    def add(self, stack, run, fields, ours):
        row = {"op": "step", "shape": self.shape, "provider": f"{stack}, {run}", "mode": "full", "stack": stack,
               "run": run, **fields, "tokens_per_s": self.tokens / fields["synced_ms"] * 1e3}
        if not ours:  # det is a promise of ours only
            row.pop("bits_repeat", None)
            row.pop("bits_vs_eager", None)
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)


def run_stack(name, make_ops, w, x, dy, docs, dims, args, report, reference):
    """Eager and graph runs of one stack (`name` labels it where it does not build); returns its eager result
    (None where it did not run eagerly)."""
    try:
        ops = make_ops(dims, args.device)
    except Skip as e:
        report.skip(name, "*", str(e))
        return None
    label = attn_label_for(ops, docs)
    print(f"{label}:", flush=True)
    eager = None
    with configured(ops.config):
        step = make_step(ops, w, x, dy, docs, dims)
        if "eager" in args.runs:
            try:
                fields, eager = run_eager(step, args)
                report.add(label, "eager", fields, ops.ours)
            except Exception as e:  # noqa: BLE001 - recorded; one stack's failure does not stop the others
                report.fail(label, "eager", e, ops.ours)
        if "graph" in args.runs:
            try:
                report.add(label, "graph", run_graph(step, args, eager if ops.ours else None), ops.ours)
            except Skip as e:
                report.skip(label, "graph", str(e))
            except Exception as e:  # noqa: BLE001
                report.fail(label, "graph", e, ops.ours)
    if eager is not None and reference is not None and not ops.ours:
        row = {"op": "step", "shape": report.shape, "provider": label, "vs": "cake det"}
        row.update({f"err_{n}": rel_rms(a, b) for n, a, b in zip(result_names(w), eager, reference)})
        report.accuracy.append(row)
    _free(args.device)
    return eager


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", choices=("regular", "irregular"), default="regular",
                    help="16 documents of 2048 tokens, or bench/model.py's 12 irregular ones (32768 tokens)")
    ap.add_argument("--runs", default="eager,graph", help="comma-separated among eager,graph")
    ap.add_argument("--no-peers", action="store_true", help="ours only")
    ap.add_argument("--rep", type=int, default=10, help="timed steps per timer")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each timer")
    ap.add_argument("--lead-ms", type=float, default=20.0,
                    help="device_ms's GPU spin before each step (longer than the host needs to queue one step)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, one step per run, wall-clock times (meaningless: checks that the stacks build "
                         "and run; on CPU through Triton's interpreter, eager only, peers skipped)")
    ap.add_argument("--out", default=None,
                    help="folder for step.json (default bench/results; a dry run: a temporary folder)")
    args = ap.parse_args(argv)
    args.runs = tuple(r for r in args.runs.split(",") if r)
    if set(args.runs) - set(RUNS):
        ap.error(f"--runs takes {RUNS}, got {args.runs}")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.dry_run:
        raise SystemExit("bench/step.py times a CUDA GPU; --dry-run runs it on CPU (Triton's interpreter)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any op's kernels load (their first call)
    dims = DRY if args.dry_run else FULL
    lens = DRY_LENS[args.docs] if args.dry_run else doc_lengths(args.docs)
    tokens = sum(lens)
    shape = (f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else f"{len(lens)} irregular docs") + f" T{tokens}"
    print(f"step: attention + GDN layer, hidden {dims.hidden}; {len(lens)} documents, {tokens} tokens; "
          f"{args.device}{' (dry run)' if args.dry_run else ''}", flush=True)
    docs = Docs.make(lens, args.device)
    w = make_weights(dims, args.device)
    x, dy = make_inputs(dims, tokens, args.device)
    report = Report(shape, tokens)
    ours = run_stack("cake det", ours_ops, w, x, dy, docs, dims, args, report, None)
    if args.no_peers:
        report.skip(PEERS, "*", "--no-peers")
    else:
        run_stack(PEERS, peer_ops, w, x, dy, docs, dims, args, report, ours)
    print()
    print_table(report.rows, ["provider", "synced_ms", "device_ms", "tokens_per_s", "peak_gb", "bits_repeat",
                              "bits_vs_eager"])
    if report.accuracy:
        print("\naccuracy: relative RMS against cake det (eager)")
        worst = [{"provider": r["provider"], "err_out": r["err_out"], "err_dx": r["err_dx"],
                  "max err_d<weight>": max(v for k, v in r.items() if k.startswith("err_d") and k != "err_dx")}
                 for r in report.accuracy]
        print_table(worst, list(worst[0]))
    for f in report.failures:
        print(f"FAILED {f['provider']} / {f['run']}: {f['reason']}")
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "mek-bench-dry-run" if args.dry_run
                                           else None)
    timers = ["synced", "device"]
    extra = {"format": FORMAT, "dry_run": args.dry_run, "complete": True, "device": args.device, "timers": timers,
             "timer_note": "Times: " + "; ".join(f"{t} = {TIMER_DOC[t]}" for t in timers) + ".",
             "modes_note": "full: one forward of both layers + autograd.grad w.r.t. the input and every weight; "
                           "eager, or replayed from one CUDA graph (provider suffix).",
             "config": {"dims": dataclasses.asdict(dims), "docs": lens, "tokens": tokens, "rep": args.rep},
             "accuracy": report.accuracy, "skipped": report.skipped, "failures": report.failures}
    path = write_results("step", report.rows, extra, out_dir=out)
    print(f"wrote {path}" + (" (dry run: the times are one step's wall time, not measurements)"
                             if args.dry_run else ""))
    ours_ran = any(r["stack"] == "cake det" for r in report.rows)
    return 0 if ours_ran and not any(f["ours"] for f in report.failures) else 1


if __name__ == "__main__":
    sys.exit(main())
