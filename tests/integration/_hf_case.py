"""The Qwen3-Next case the transformers-integration tests share (CPU through the interpreter, GPU at hidden 2048).

One set of bf16 weights, a few documents (one of them a single token):
- reference: the unpatched HF model in FP64 on the padded batch (attention mask; HF computes padded batches
  correctly). HF's FP64 run still computes its norms, RoPE tables and GDN core in fp32 (HF casts there): ~1e-7,
  four orders below the bf16 errors compared here.
- HF bf16: the unpatched model on the same padded batch (HF's torch fallbacks, sdpa): its error against the
  reference, per output and per parameter group, is the budget's unit.
- ours: `apply_to_qwen3_next(model)` in bf16 on the padded batch, on the packed batch of
  DataCollatorWithFlattening(return_flash_attn_kwargs=True) (cu_seq_lens_q/k), and on its position-ids-only
  packed batch (the collator's default).
Errors are relative RMS, |x - ref| / |ref|, over a parameter group (one kind of parameter over all layers: the
layer index is dropped from the name).
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

BF = torch.bfloat16


def config(*, hidden, layers, heads, kv_heads, k_heads, v_heads, vocab, intermediate):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=len(layers),
        layer_types=list(layers), num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0, initializer_range=0.05,
        max_position_embeddings=4096, tie_word_embeddings=False)


def base_model(cfg, seed=0, cls=None):
    """The bf16 weights every run starts from (norm weights drawn away from their init, so (1 + w) and w count)."""
    if cls is None:
        from transformers import Qwen3NextForCausalLM as cls

    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(BF)


def batches(lens, vocab, device, seed=0):
    """(padded, packed with cu_seq_lens kwargs, packed with position ids only, the documents' token ids)."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    b, s = len(lens), max(lens)
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)] = d
        mask[i, :len(d)] = 1
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    feats = [{"input_ids": d.tolist()} for d in docs]
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
    pos_only = DataCollatorWithFlattening()(feats)
    assert "cu_seq_lens_q" not in pos_only

    def to(batch):
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    return to(padded), to(packed), to(pos_only), docs


def run(model, batch):
    """Forward + backward: (logits fp64, loss fp64, {parameter name: grad fp64})."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), out.loss.detach().double(), grads


def group_of(name: str) -> str:
    return re.sub(r"\.\d+\.", ".", name).removeprefix("model.")


def rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def groups(ref):
    """{group: parameter names}."""
    out: dict[str, list[str]] = {}
    for n in ref:
        out.setdefault(group_of(n), []).append(n)
    return dict(sorted(out.items()))


def per_group(grads, ref):
    """{group: relative RMS error of the concatenated gradients}."""
    return {g: rel(torch.cat([grads[n].flatten() for n in ns]), torch.cat([ref[n].flatten() for n in ns]))
            for g, ns in groups(ref).items()}


def doc_rows(lens):
    """(row, positions) of each document in the padded batch, and its slice of the packed row."""
    out, start = [], 0
    for i, n in enumerate(lens):
        out.append((i, slice(0, n), slice(start, start + n)))
        start += n
    return out


def fresh(base):
    return copy.deepcopy(base)


def decode_inputs(vocab, low=0, seed=3):
    """A prefill of two rows (the first left-padded) and two decode steps: (ids [2, 6], mask [2, 6], steps [2, 2])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (2, 6), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return ids, mask, torch.randint(low, vocab, (2, 2), generator=g)


def decode_logits(model, ids, mask, steps):
    """The last position's logits of the prefill and of each decode step with the model's cache, [1 + steps, 2,
    vocab] in FP64."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        logits, past, m = [out.logits[:, -1]], out.past_key_values, mask
        for t in range(steps.shape[1]):
            m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
            out = model(input_ids=steps[:, t:t + 1], attention_mask=m, past_key_values=past, use_cache=True)
            logits.append(out.logits[:, -1])
            past = out.past_key_values
    return torch.stack(logits).double()


def check_decode(got, hf, ref):
    """Each step's logits within RATIO x HF bf16's error of the FP64 run."""
    for t in range(got.shape[0]):
        budget = RATIO * rel(hf[t], ref[t])
        assert rel(got[t], ref[t]) <= budget, f"step {t}: {rel(got[t], ref[t]):.3e} > {budget:.3e}"


# --- the comparison the tests run ---------------------------------------------------------------------------------
RATIO = 1.5
# Parameters whose gradient reaches them only through the GDN decay input g (A_log, dt_bias; Qwen3.5's in_proj_a,
# DECAY_DRIVEN) are sums over tokens of dL/dg_t times a factor, with heavy cancellation (in the CPU cases the sum is
# 1/100 - 1/200 of the sum of its terms' magnitudes), so their relative error is the per-token error of dL/dg
# amplified ~100x. The GDN backward keeps dL/dg accurate under any decay (its dG leaves out the terms that cancel,
# kernels' bwd_dqkw_kernel; HF's init draws A = exp(A_log) up to 16, a per-token log decay near -20), and at the GPU
# test's size (4 500 tokens) they are held to the ratio (measured ours / HF bf16: A_log 1.03, dt_bias 1.02). The
# CPU models have 13 - 20 tokens and 2 - 4 such parameters per group, too few for a stable ratio: measured over
# seeds 0 - 3 (Qwen3-Next and Qwen3.5 models below) A_log 0.1 - 37, dt_bias 0.03 - 6.7, in_proj_a 0.6 - 1.5, with
# per-token dL/dg 0.45 - 2.2 (HF's own A_log errors 0.15 - 39 %: a lucky-small unit makes the large ratios).
# There (hold_decay=False) they are checked finite, and dL/dg of every GDN layer within DG_WIRING of FP64, which a
# wiring bug (sign, scale, head mapping, l2 norm) of O(1) cannot pass.
DG_WIRING = 0.25
DECAY_DRIVEN = ("layers.linear_attn.A_log", "layers.linear_attn.dt_bias", "layers.linear_attn.in_proj_a.weight",
                # Kimi-Linear's forget gate: A_log, dt_bias and its two projections feed only the KDA decay
                "layers.self_attn.forget_gate.A_log", "layers.self_attn.forget_gate.dt_bias",
                "layers.self_attn.forget_gate.f_a_proj.weight", "layers.self_attn.forget_gate.f_b_proj.weight")
ENTRY_POINTS = {"gqa": "varlen_gqa_attention", "gdn": "chunk_gated_delta_rule", "conv1d": "causal_conv1d",
                "gated_rmsnorm": "rmsnorm_silu_gate", "rmsnorm": "zero_centered_rmsnorm", "kda": "chunk_kda"}


def counting(mp, counts):
    """Count the calls of every public entry point (the integration looks them up on their declaration module)."""
    import importlib

    for op, fn in ENTRY_POINTS.items():
        mod = importlib.import_module(f"miles_ext_kernels.cake.{op}")
        orig = getattr(mod, fn)

        def wrapped(*a, _orig=orig, _fn=fn, **k):
            counts[_fn] += 1
            return _orig(*a, **k)
        mp.setattr(mod, fn, wrapped)


def capture_dg(mp, mod, name, sink, orig=None):
    """Wrap the GDN core `mod.name` (or run `orig` in its place) so that each call's dL/dg (fp64) lands in `sink`,
    in call (= layer) order."""
    orig = orig or getattr(mod, name)

    def wrapped(*a, **k):
        g = a[3] if len(a) > 3 else k["g"]
        i = len(sink)
        sink.append(None)
        if g.requires_grad:
            g.register_hook(lambda grad: sink.__setitem__(i, grad.detach().double()))
        return orig(*a, **k)
    mp.setattr(mod, name, wrapped)


def build_case(cfg, lens, device, seed=0, *, cls=None, apply=None, hf_module=None,
               runs=("padded", "packed", "pos_only"), core="torch_chunk_gated_delta_rule", dg=True):
    """Every run the tests compare (see the module docstring); Qwen3-Next unless cls / apply / hf_module say. core:
    HF's linear-attention core function (its torch fallback runs the HF runs); dg: capture each GDN layer's dL/dg
    (HF's core and ours take the same log decay g; Kimi-Linear's take different ones)."""
    import importlib
    import inspect
    from collections import Counter

    import pytest

    from miles_ext_kernels.cake import gdn
    from miles_ext_kernels.integrations import transformers as integration

    apply = apply or integration.apply_to_qwen3_next
    hf_mod = importlib.import_module(hf_module or "transformers.models.qwen3_next.modeling_qwen3_next")
    base = base_model(cfg, seed, cls).to(device)
    padded, packed, pos_only, _ = batches(lens, cfg.vocab_size, device, seed)
    out = dict(mask=padded["attention_mask"].bool(), lens=list(lens), counts={}, dg={})
    with pytest.MonkeyPatch.context() as mp:
        for name, dtype in (("ref", torch.float64), ("hf", BF)):
            # HF's own torch code even where fla / causal-conv1d were importable (they serve neither FP64 nor the
            # padded reference's semantics): the hooks' innermost functions
            torch_core = inspect.unwrap(getattr(hf_mod, core))
            mp.setattr(hf_mod, "causal_conv1d_fn", inspect.unwrap(hf_mod.causal_conv1d_fn))
            if dg:
                capture_dg(mp, hf_mod, core, out["dg"].setdefault(name, []), torch_core)
            else:
                mp.setattr(hf_mod, core, torch_core)
            out[name] = run(fresh(base).to(dtype), padded)
            mp.undo()
        m = out["mask"]
        out["dg"] = {k: [d[m] for d in v] for k, v in out["dg"].items()}  # padded [B, S, HV] -> [T, HV]
        with torch.no_grad():
            mp.setattr(hf_mod, "causal_conv1d_fn", inspect.unwrap(hf_mod.causal_conv1d_fn))
            mp.setattr(hf_mod, core, inspect.unwrap(getattr(hf_mod, core)))
            out["hf_packed_logits"] = fresh(base)(**pos_only).logits.double()
            mp.undo()
        ours = fresh(base)
        out["report"], out["again"], out["model"] = apply(ours), apply(ours), ours
        batches_ = {"padded": padded, "packed": packed, "pos_only": pos_only}
        for name, batch in ((r, batches_[r]) for r in runs):
            c = out["counts"][name] = Counter()
            counting(mp, c)
            sink = []
            if dg:
                capture_dg(mp, gdn, "chunk_gated_delta_rule", sink)
            out[name] = run(ours, batch)
            if dg:
                out["dg"][name] = [d[0] for d in sink]
            mp.undo()
    return out


def _check(name, err, budget, ours, ref, reject=1.02):
    """err within budget, and the budget rejects `ours` scaled by `reject` (2 %), or, where the unit (HF bf16's own
    error, budget / RATIO) is already near 2 % so that no budget of RATIO units can reject 2 % (the GPU model's
    logits: HF bf16 is 2.3 % off FP64 there), by 1 + 2 units: the budget still rejects an error twice HF's."""
    assert err <= budget, f"{name}: error {err:.3e} > budget {budget:.3e}"
    if reject is not None:
        reject = max(reject, 1 + 2 * budget / RATIO)
        assert rel(ours * reject, ref) > budget, f"{name}: budget {budget:.3e} does not reject a {reject - 1:.1%} error"


def compare(case, which, hold_decay=False, finite_only=()):
    """Assert run `which` against the FP64 reference within the budgets; returns {output or group: ours / HF}.
    hold_decay: the DECAY_DRIVEN groups and dL/dg are held to the ratio too (the GPU model's size). finite_only:
    groups checked finite but not held to the ratio (a caller says why)."""
    (ref_logits, ref_loss, ref_grads), (hf_logits, hf_loss, hf_grads) = case["ref"], case["hf"]
    logits, loss, grads = case[which]
    m = case["mask"]
    logits = logits[m] if logits.shape[0] == m.shape[0] else logits[0]
    hf_lerr = rel(hf_logits[m], ref_logits[m])
    ratios = {"logits": rel(logits, ref_logits[m]) / hf_lerr, "loss": rel(loss, ref_loss) / rel(hf_loss, ref_loss)}
    _check("logits", rel(logits, ref_logits[m]), RATIO * hf_lerr, logits, ref_logits[m])
    # The loss is one number, a mean over n label tokens whose errors cancel at random: its unit is HF's loss error
    # or the error of a mean of n terms each off by HF's logits error, whichever is larger.
    n = sum(max(x - 1, 0) for x in case["lens"])
    _check("loss", rel(loss, ref_loss), RATIO * max(rel(hf_loss, ref_loss), hf_lerr / n ** 0.5), loss, ref_loss)
    assert set(grads) == set(ref_grads), "a parameter lost (or gained) its gradient"
    hf_err, ours_err = per_group(hf_grads, ref_grads), per_group(grads, ref_grads)
    for grp, names in groups(ref_grads).items():
        ratios[grp] = ours_err[grp] / hf_err[grp]
        assert all(bool(grads[x].isfinite().all()) for x in names), grp
        if (grp in DECAY_DRIVEN and not hold_decay) or grp in finite_only:
            continue
        ours_g = torch.cat([grads[x].flatten() for x in names])
        ref_g = torch.cat([ref_grads[x].flatten() for x in names])
        _check(grp, ours_err[grp], RATIO * hf_err[grp], ours_g, ref_g, reject=1.05)
    if not case["dg"]:  # not captured (build_case(dg=False))
        return ratios
    dg_ref, dg_hf, dg_ours = case["dg"]["ref"], case["dg"]["hf"], case["dg"][which]
    assert len(dg_ref) == len(dg_hf) == len(dg_ours) > 0
    for i, (r, h, o) in enumerate(zip(dg_ref, dg_hf, dg_ours)):
        ratios[f"dL/dg {i}"] = rel(o, r) / rel(h, r)
        assert bool(o.isfinite().all()) and rel(o, r) <= DG_WIRING, f"GDN layer {i}: dL/dg {rel(o, r):.3e} off FP64"
        if hold_decay:
            assert rel(o, r) <= RATIO * rel(h, r), f"GDN layer {i}: dL/dg {rel(o, r):.3e}, HF's {rel(h, r):.3e}"
    return ratios


def check_documents(case, which="packed"):
    """Each document of a packed run against its FP64 reference and against the padded run."""
    ref_logits, hf_logits = case["ref"][0], case["hf"][0]
    packed, padded = case[which][0][0], case["padded"][0]
    for row, pos, span in doc_rows(case["lens"]):
        r = ref_logits[row, pos]
        budget = RATIO * max(rel(hf_logits[row, pos], r), 1e-3)
        assert rel(packed[span], r) <= budget, f"document {row} (packed) off its FP64 reference"
        assert rel(packed[span], padded[row, pos]) <= budget, f"document {row}: packed != padded"


def leak_factor(case):
    """How far HF's own packed run is off on the documents after the first, in units of the per-document budget."""
    ref_logits, hf_logits, leak = case["ref"][0], case["hf"][0], case["hf_packed_logits"][0]
    worst = 0.0
    for row, pos, span in doc_rows(case["lens"])[1:]:
        r = ref_logits[row, pos]
        worst = max(worst, rel(leak[span], r) / (RATIO * max(rel(hf_logits[row, pos], r), 1e-3)))
    return worst


def check_det(case):
    (la, sa, ga), (lb, sb, gb) = case["packed"], case["pos_only"]
    assert torch.equal(la, lb) and torch.equal(sa, sb)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


class CaseChecks:
    """The checks every model's GPU case runs: a test module subclasses this as `Test<Model>` beside its module-scoped
    `case` fixture (`build_case`)."""

    @pytest.mark.parametrize("which", ["padded", "packed", "pos_only"])
    def test_within_budget_of_fp64(self, case, which):
        ratios = compare(case, which, hold_decay=True)
        print(f"\n{which}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))

    def test_documents_isolated(self, case):
        check_documents(case)
        assert leak_factor(case) > 5

    def test_det_bits_on_a_repeat(self, case):
        check_det(case)
