"""Model-level benchmark: HF transformers' Qwen3NextForCausalLM, forward + backward, three stacks in one run.

A 4-layer Qwen3-Next-shaped model (hidden 2048; layers linear / linear / linear / full, Qwen3-Next's 3:1;
attention 16 q / 2 kv heads at head dim 256; GDN 16 key / 32 value heads at 128 / 128, conv width 4; a dense MLP of
5632, the active width of Qwen3-Next-80B-A3B's MoE: 10 routed experts x 512 + a shared 512; vocab 32768 by default,
since the LM head is no op of ours and is the same in every stack), bf16 weights, on 32768 tokens: 16 documents of
2048 (--docs irregular: 12 of irregular lengths). One step = forward + loss.backward() (no optimizer).
Stacks (each from the same weights):
- HF torch (padded): HF's own code, its torch fallbacks for the GDN core and conv (even where fla / causal-conv1d
  are installed) and sdpa attention, on the padded [B, S] batch with an attention mask.
- HF + fla + FA2 (packed): where importable, fla's chunk_gated_delta_rule as HF's GDN hook, causal-conv1d's
  causal_conv1d_fn as its conv hook where installed (else HF's torch conv), attn_implementation="flash_attention_2",
  on DataCollatorWithFlattening's packed batch with cu_seq_lens_q/k. Its conv does not see the documents (neither
  hook takes cu_seqlens), so its conv taps cross documents.
- HF + fla + FA2 varlen, torch aten (packed): where fla imports and flash_attn does not (the GPU machine of record
  has no flash_attn build): the same peer with torch's own FA2 varlen kernels (aten ops, as bench/gqa.py's FA2
  peer) registered as HF attention implementation "torch_fa2_varlen"; the bar is measured against it.
- HF + fla + sdpa (padded): the same without FA2, sdpa attention on the padded batch (which HF computes correctly:
  right padding, no state leak); the bar's peer where torch has no FA2 varlen op.
- HF + cake (packed): `apply_to_qwen3_next(model)` on the same packed batch (every layer document-isolated); also on
  the padded batch (unpadded internally).
Times: `median_ms` (one sync per step: the host's work counts) and `device_ms` (the host's launch work hidden
behind a GPU spin); tokens/s from the synced time; peak memory (max_memory_allocated during a step, weights
included). det: ours repeats the loss and every gradient bit for bit. Bar: ours >= 1.3x the fla + FA2 stack's
tokens/s (or, without flash_attn, the fla + sdpa stack's). Prints a table; writes bench/results/model.json.

    python bench/model.py [--docs regular|irregular] [--vocab 32768] [--layers 4] [--quick] [--bar-only]
"""
from __future__ import annotations

import argparse
import copy
import gc
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import AtenFA2Varlen, device_ms, has_aten_fa2, median_ms, print_table, write_results  # noqa: E402

TOKENS = 32768
BAR = 1.3


def doc_lengths(kind: str) -> list[int]:
    if kind == "regular":
        return [2048] * 16
    g = torch.Generator().manual_seed(1)
    cuts = sorted(torch.randperm(TOKENS - 1, generator=g)[:11].add(1).tolist())
    b = [0] + cuts + [TOKENS]
    return [y - x for x, y in zip(b[:-1], b[1:])]


def build(layers: int, vocab: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                          layer_types=[kinds[i % 4] for i in range(layers)], num_attention_heads=16,
                          num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                          num_experts=0, max_position_embeddings=TOKENS, use_cache=False)
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16), cfg


def make_batches(lens, vocab):
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    b, s = len(lens), max(lens)
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)] = d, 1
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])
    to = (lambda batch: {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()})  # noqa: E731
    return to(padded), to(packed)


class Hooks:
    """Set HF's module-level kernel hooks of modeling_qwen3_next for one stack, and put them back."""

    NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")

    def __init__(self, **fns):
        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        self.mod, self.fns = mod, fns
        self.saved = {n: getattr(mod, n) for n in self.NAMES}

    @classmethod
    def torch_only(cls):
        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        return cls(**{n: inspect.unwrap(getattr(mod, n)) for n in cls.NAMES})

    def __enter__(self):
        for n, f in self.fns.items():
            setattr(self.mod, n, f)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(self.mod, n, f)


def fla_hooks():
    """(Hooks for HF + fla (+ causal-conv1d), a label) or (None, why)."""
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except Exception as e:  # noqa: BLE001 - not installed / not importable here
        return None, f"fla not importable ({type(e).__name__})"
    chunk_o.TRITON_ABOVE_3_7_1 = True  # fla refuses triton 3.4 - 3.7.0 on Hopper for its gated backward (bench/gdn.py)

    def gdn_hook(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        return fla_gdn(query, key, value, g=g, beta=beta, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())

    fns = {"torch_chunk_gated_delta_rule": gdn_hook}
    label = "fla"
    try:
        from causal_conv1d import causal_conv1d_fn as dao_conv

        def conv_hook(hidden_states, weight, bias=None, activation=None, **kwargs):
            return dao_conv(hidden_states, weight, bias, activation=activation)

        fns["causal_conv1d_fn"] = conv_hook
        label += " + causal-conv1d"
    except Exception:  # noqa: BLE001
        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        fns["causal_conv1d_fn"] = inspect.unwrap(mod.causal_conv1d_fn)
        label += " + torch conv"
    return Hooks(**fns), label


TORCH_FA2 = "torch_fa2_varlen"


def register_torch_fa2() -> str | None:
    """Register torch's own FlashAttention-2 varlen kernels (the aten ops bench/gqa.py's "FA2 varlen" peer calls,
    in every CUDA build of torch) as the HF attention implementation "torch_fa2_varlen", for the packed batch: it
    reads DataCollatorWithFlattening's cu_seq_lens_q / max_length_q as HF's flash_attention_2 does. Returns the
    name, or None where this torch has no such op."""
    if not has_aten_fa2():
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if cu is None or query.shape[0] != 1:
            raise ValueError("torch_fa2_varlen serves the packed batch only (cu_seq_lens_q / max_length_q)")
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [B, H, S, D] -> [S, H, D]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        o = AtenFA2Varlen.apply(q, k, v, cu.to(torch.int32), int(max_len), scale)
        return o[None], None  # [1, S, H, D], as HF's flash_attention_2 returns

    AttentionInterface.register(TORCH_FA2, attention)
    AttentionMaskInterface.register(TORCH_FA2, flash_attention_mask)
    return TORCH_FA2


def fa2_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def step_fn(model, batch):
    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    return step


def measure(name, model, batch, tokens, quick):
    step = step_fn(model, batch)
    step()  # first call: compiles / autotunes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    rep = 3 if quick else 10
    ms = median_ms(step, warmup=1, rep=rep)
    dms = device_ms(step, warmup=1, rep=rep)
    row = {"stack": name, "step ms": ms, "device ms": dms, "tokens/s": tokens / ms * 1e3, "peak GB": peak}
    print(f"  {name}: {ms:.1f} ms, {row['tokens/s']:.0f} tokens/s, peak {peak:.1f} GB", flush=True)
    return row


def det_bits(model, batch) -> bool:
    def once():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (la, ga), (lb, gb) = once(), once()
    return bool(torch.equal(la, lb)) and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", choices=("regular", "irregular"), default="regular")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-hf-torch", action="store_true", help="skip HF's torch fallbacks (the slowest stack)")
    ap.add_argument("--bar-only", action="store_true",
                    help="only ours (packed) and the bar's peer: the stacks the bar compares, in one short run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/model.py needs a CUDA GPU")
    from miles_ext_kernels.integrations.transformers import apply_to_qwen3_next

    lens = doc_lengths(args.docs)
    base, cfg = build(args.layers, args.vocab)
    padded, packed = make_batches(lens, args.vocab)
    tokens = sum(lens)
    print(f"{args.layers}-layer Qwen3-Next-shaped model, hidden 2048, vocab {args.vocab}; {len(lens)} documents, "
          f"{tokens} tokens (padded batch {tuple(padded['input_ids'].shape)})", flush=True)
    rows, notes = [], {}

    def run(name, make, batch, hooks=None):
        model = make()
        try:
            if hooks is None:
                return measure(name, model, batch, tokens, args.quick), model
            with hooks:
                return measure(name, model, batch, tokens, args.quick), model
        except torch.cuda.OutOfMemoryError as e:
            notes[name] = f"out of memory: {e}".splitlines()[0]
            print(f"  {name}: {notes[name]}")
            return None, None

    def fresh(attn=None):
        m = copy.deepcopy(base)
        if attn:
            m.set_attn_implementation(attn)
        return m

    def done(model):
        del model
        gc.collect()
        torch.cuda.empty_cache()

    def ours_model():
        m = fresh()
        apply_to_qwen3_next(m)
        return m

    # ours first, then the bar's peer, then the rest (slowest last): a run cut by a time limit keeps the bar
    ours, m = run("HF + cake (packed)", ours_model, packed)
    if ours:
        ours["det"] = det_bits(m, packed)
        rows.append(ours)
        done(m)
    hooks, label = fla_hooks()
    peer, peer_name = None, "fla + FA2"
    if hooks is None:
        notes["HF + fla"] = f"skipped: {label}"
    elif not fa2_available():
        torch_fa2 = register_torch_fa2()
        if torch_fa2:  # the same FA2 varlen kernels, from torch's build
            notes["HF + fla + FA2"] = "flash_attn not importable: FA2 varlen through torch's aten kernels"
            peer_name = "fla + FA2 (torch)"
            peer, m = run(f"HF + {label} + FA2 varlen, torch aten (packed)", lambda: fresh(torch_fa2), packed,
                          hooks)
            rows += [peer] if peer else []
            done(m)
        if peer is None or not args.bar_only:
            row, m = run(f"HF + {label} + sdpa (padded)", lambda: fresh("sdpa"), padded, hooks)
            if row and peer is None:
                notes["HF + fla + FA2"] = "skipped: no FA2 varlen; the bar is measured against HF + fla + sdpa"
                peer, peer_name = row, "fla + sdpa"
            rows += [row] if row else []
            done(m)
    else:
        peer, m = run(f"HF + {label} + FA2 (packed)", lambda: fresh("flash_attention_2"), packed, hooks)
        rows += [peer] if peer else []
        done(m)
    if not args.bar_only:
        row, m = run("HF + cake (padded)", ours_model, padded)
        if row:
            rows.append(row)
            done(m)
    if not (args.no_hf_torch or args.bar_only):
        row, m = run("HF torch fallbacks + sdpa (padded)", lambda: fresh("sdpa"), padded, Hooks.torch_only())
        rows += [row] if row else []
        done(m)
    for r in rows:
        r["vs peer"] = r["tokens/s"] / peer["tokens/s"] if peer else None
    print()
    print_table(rows, ["stack", "step ms", "device ms", "tokens/s", "peak GB", "vs peer", "det"])
    bar = None
    if ours and peer:
        bar = ours["tokens/s"] >= BAR * peer["tokens/s"]
        print(f"\nbar (ours >= {BAR}x {peer_name} tokens/s, det): {'met' if bar and ours['det'] else 'NOT met'} "
              f"({ours['tokens/s'] / peer['tokens/s']:.2f}x, det {ours['det']})")
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    bar_info = {"ratio": BAR, "met": bar, "peer": peer_name if peer else None}
    path = write_results("model", rows, {"config": {"layers": args.layers, "hidden": 2048, "vocab": args.vocab,
                                                    "docs": lens, "tokens": tokens},
                                         "bar": bar_info, "notes": notes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
