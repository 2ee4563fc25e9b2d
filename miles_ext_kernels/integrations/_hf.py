"""The transformers integration's implementation (imports torch and transformers; see `transformers.py`).

Only the ops' public entry points and their declarations' `check_supported` are used. Entry points are looked up
on their declaration module at call time (`_gqa.varlen_gqa_attention(...)`), so a wrapper installed there (a
test's call counter, a profiler) sees every call.
"""
from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_ext_kernels.cake import conv1d as _conv1d
from miles_ext_kernels.cake import gated_rmsnorm as _gated
from miles_ext_kernels.cake import gdn as _gdn
from miles_ext_kernels.cake import gqa as _gqa
from miles_ext_kernels.cake import kda as _kda
from miles_ext_kernels.cake import rmsnorm as _rmsnorm

from .transformers import ATTN_IMPLEMENTATION as ATTN

VARLEN_KW = "cake_varlen"  # the kwarg the text-model wrapper hands every layer (HF threads **kwargs through)
_TAG = "_cake_patched"  # set on every function we install (class or instance attribute)


# ---------------------------------------------------------------------------------------------------------------
# families
@dataclass(frozen=True)
class Family:
    key: str
    module: str        # transformers' modelling module
    prefix: str        # class-name prefix
    text_model: str    # the decoder stack whose forward gets the varlen wrapper
    projection: str    # "qkvz": Qwen3-Next's fused, key-head-grouped in_proj_qkvz / in_proj_ba; "qkv": Qwen3.5's;
                       # "kda": Kimi-Linear's q / k / v, forget-gate and output-gate projections
    apply_name: str
    linear: str = "GatedDeltaNet"  # the linear-attention layer's class-name suffix
    served: tuple = ("attention", "linear_attention", "norms")  # what the cake ops can take over in this family

    def classes(self):
        mod = importlib.import_module(self.module)
        p = self.prefix
        return types.SimpleNamespace(mod=mod, text_model=getattr(mod, self.text_model),
                                     attention=getattr(mod, f"{p}Attention"),
                                     linear=getattr(mod, f"{p}{self.linear}"),
                                     gated_norm=getattr(mod, f"{p}RMSNormGated"),
                                     norm=getattr(mod, f"{p}RMSNorm"))


FAMILIES = {
    "qwen3_next": Family("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3Next",
                         "Qwen3NextModel", "qkvz", "apply_to_qwen3_next"),
    "qwen3_5": Family("qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5",
                      "Qwen3_5TextModel", "qkv", "apply_to_qwen3_5"),
    "qwen3_5_moe": Family("qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe",
                          "Qwen3_5MoeTextModel", "qkv", "apply_to_qwen3_5_moe"),
    # Kimi-Linear: its full attention is MLA (q / k head dim 192, v 128) and its norms are a plain RMSNorm and a
    # sigmoid-gated one: none of them is a cake op, only the KDA layers are
    "kimi_linear": Family("kimi_linear", "transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinear",
                          "KimiLinearModel", "kda", "apply_to_kimi_linear", linear="DeltaAttention",
                          served=("linear_attention",)),
}
# attention implementations of HF that keep the documents of a packed batch apart (for the layers cake leaves to HF)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn", ATTN)


@dataclass
class Parts:
    """What is patched for one text model (instance patch) or one family's classes (class patch)."""
    attention: bool = False
    linear_attention: bool = False
    norms: bool = False

    def any_varlen(self) -> bool:
        return self.attention or self.linear_attention

    def key(self) -> tuple[bool, bool, bool]:
        return self.attention, self.linear_attention, self.norms


def _merged(*parts) -> Parts:
    ps = [p for p in parts if p is not None]
    return Parts(any(p.attention for p in ps), any(p.linear_attention for p in ps), any(p.norms for p in ps))


_CLASS_PARTS: dict[str, Parts] = {}          # family key -> parts patched on its classes
_ORIGINALS: dict[tuple[type, str], object] = {}  # (class, attribute) -> HF's function, for _revert_classes


# ---------------------------------------------------------------------------------------------------------------
# documents of one forward
class Varlen:
    """Where the documents of one forward lie: `cu_seqlens` int32 [N + 1] over the T kept tokens, `max_seqlen` (a
    host int), `indices` int64 [T] into the flattened B * S tokens (None: every token is kept, in order), the
    batch B and length S of the hidden states it describes, and N (host int)."""

    __slots__ = ("cu_seqlens", "max_seqlen", "indices", "batch", "seqlen", "n_docs", "_bs")

    def __init__(self, cu_seqlens, max_seqlen, indices, batch, seqlen, n_docs):
        self.cu_seqlens, self.max_seqlen, self.indices = cu_seqlens, int(max_seqlen), indices
        self.batch, self.seqlen, self.n_docs = batch, seqlen, n_docs
        self._bs = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen if self.indices is None else self.indices.numel()

    def fits(self, batch, seqlen) -> bool:
        return self.batch == batch and self.seqlen == seqlen

    def gather(self, x):
        """[B, S, ...] -> [T, ...] (a view when nothing is dropped and x is contiguous over B, S)."""
        flat = x.reshape(self.batch * self.seqlen, *x.shape[2:])
        return flat if self.indices is None else flat.index_select(0, self.indices)

    def gather_heads(self, x):
        """[B, H, S, D] (HF's attention layout) -> [T, H, D], contiguous (one copy)."""
        if self.indices is None:
            return x.transpose(1, 2).reshape(self.batch * self.seqlen, x.shape[1], x.shape[3]).contiguous()
        if self._bs is None:
            self._bs = (torch.div(self.indices, self.seqlen, rounding_mode="floor"), self.indices % self.seqlen)
        b, s = self._bs
        return x[b, :, s]

    def scatter(self, y):
        """[T, ...] -> [B, S, ...], zeros at the dropped (padding) tokens; differentiable."""
        if self.indices is not None:
            y = y.new_zeros(self.batch * self.seqlen, *y.shape[1:]).index_copy(0, self.indices, y)
        return y.reshape(self.batch, self.seqlen, *y.shape[1:])


def _rows(batch, seqlen, device) -> Varlen:
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)[: batch + 1]
    return Varlen(cu, seqlen, None, batch, seqlen, batch)


def _from_mask(mask, device) -> Varlen:
    """Each row's kept tokens (mask != 0) are one document (they need not be contiguous)."""
    batch, seqlen = mask.shape
    valid = mask.to(device=device, dtype=torch.bool)
    lens = valid.sum(1, dtype=torch.int32)
    cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    longest, kept = torch.stack([lens.max(), lens.sum()]).tolist() if batch else (0, 0)  # one device sync
    indices = None if kept == batch * seqlen else valid.reshape(-1).nonzero().squeeze(1)
    return Varlen(cu, longest, indices, batch, seqlen, batch)


def _from_position_ids(pos, batch, seqlen, device) -> Varlen:
    """A document starts at every row start and wherever the position does not follow the previous one + 1."""
    pos = pos.reshape(batch, seqlen).to(device)
    start = torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    first = start.reshape(-1).nonzero().squeeze(1).to(torch.int32)  # device sync (nonzero)
    n_docs = first.numel()
    if n_docs == batch:
        return _rows(batch, seqlen, device)
    cu = torch.cat([first, first.new_tensor([batch * seqlen])])
    return Varlen(cu, int(cu.diff().max()), None, batch, seqlen, n_docs)


def _from_kwargs(kwargs, batch, seqlen, device, where) -> Varlen:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k.shape != cu_q.shape:
        raise ValueError(f"{where}: cu_seq_lens_q and cu_seq_lens_k differ; packed training runs queries and keys "
                         "over the same documents (self-attention)")
    if batch != 1:
        raise ValueError(f"{where}: cu_seq_lens_q describes one flattened row ([1, T] inputs), got batch {batch}")
    cu = cu_q.to(device=device, dtype=torch.int32)
    longest = kwargs.get("max_length_q")
    longest = int(cu.diff().max()) if longest is None else int(longest)
    return Varlen(cu, longest, None, batch, seqlen, cu.numel() - 1)


def _text_position_ids(position_ids, batch):
    """The 2D text position ids, or None (Qwen3.5 hands [4, B, S] with text positions first; [3, B, S] multimodal
    RoPE ids carry no document boundaries)."""
    if position_ids is None:
        return None
    if position_ids.ndim == 3:
        return position_ids[0] if position_ids.shape[0] == 4 else None
    return position_ids.expand(batch, -1) if position_ids.ndim == 2 else None


def build_varlen(batch, seqlen, device, *, attention_mask=None, position_ids=None, kwargs=None, past_len=0,
                 where="cake") -> Varlen:
    kwargs = kwargs or {}
    if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.ndim != 2):
        raise ValueError(f"{where}: a precomputed or 4D attention mask cannot be honoured by the cake ops (causal "
                         "attention over documents); pass a 2D padding mask, position ids or cu_seq_lens_q/k")
    if kwargs.get("cu_seq_lens_q") is not None:
        if attention_mask is not None:
            raise ValueError(f"{where}: pass either cu_seq_lens_q/k (a packed batch) or a 2D attention_mask "
                             "(a padded batch), not both")
        return _from_kwargs(kwargs, batch, seqlen, device, where)
    if attention_mask is not None:
        return _from_mask(attention_mask[:, -seqlen:], device)
    pos = _text_position_ids(position_ids, batch)
    if pos is not None and past_len == 0:
        return _from_position_ids(pos, batch, seqlen, device)
    return _rows(batch, seqlen, device)


# ---------------------------------------------------------------------------------------------------------------
# checks: a clear error naming the module and the op, never a silent fallback
def _name(module) -> str:
    return getattr(module, "_cake_name", None) or type(module).__name__


def _served(module, op, check, *args, **kwargs):
    try:
        check(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_name(module)} ({type(module).__name__}) is not served by cake {op}: {e}") from None


def _need_bf16(module, op, **tensors):
    for what, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{_name(module)} ({type(module).__name__}): cake {op} runs bf16, got {what} in "
                            f"{t.dtype} (load or cast the model in torch.bfloat16)")


def check_attention(module):
    cfg = module.config
    _served(module, "gqa", _gqa.check_supported, cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim)
    if getattr(cfg, "sliding_window", None) and "sliding" in str(getattr(module, "layer_type", "")):
        raise ValueError(f"{_name(module)}: sliding-window attention is not served by cake gqa")


def check_gdn(module):
    _served(module, "gdn", _gdn.check_supported, module.head_k_dim, module.head_v_dim, module.num_k_heads,
            module.num_v_heads)
    conv = module.conv1d
    _served(module, "conv1d", _conv1d.check_supported, kernel_size=module.conv_kernel_size,
            activation=module.activation, has_bias=conv.bias is not None,
            weight_dtype=str(conv.weight.dtype).removeprefix("torch."), x_dtype="bfloat16")


def check_kda(module):
    _served(module, "kda", _kda.check_supported, module.head_dim, module.head_dim, module.num_heads, module.num_heads)
    conv = module.conv1d
    _served(module, "conv1d", _conv1d.check_supported, kernel_size=module.conv_kernel_size,
            activation=module.activation, has_bias=conv.bias is not None,
            weight_dtype=str(conv.weight.dtype).removeprefix("torch."), x_dtype="bfloat16")


def check_gated_norm(module):
    _served(module, "gated_rmsnorm", _gated.check_supported, int(module.weight.shape[0]))
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        raise ValueError(f"{_name(module)}: gate activation {module.activation!r} is not served by cake "
                         "gated_rmsnorm (silu only)")


def check_norm(module):
    _served(module, "rmsnorm", _rmsnorm.check_supported, int(module.weight.shape[0]))


# ---------------------------------------------------------------------------------------------------------------
# the patched pieces
def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """HF attention interface "cake": query [B, Hq, Sq, D], key / value [B, Hkv, Sk, D] -> ([B, Sq, Hq, D], None).

    attention_mask is our mask function's 2D padding mask over the keys (or None). The documents come from the
    text-model wrapper (kwarg `cake_varlen`); a continuation of a cache (Sk > Sq) finds its keys from the mask."""
    batch, _, seqlen, _ = query.shape
    kv_len = key.shape[2]
    if dropout:
        raise ValueError(f"{_name(module)}: attention dropout {dropout} is not served by cake gqa "
                         "(set config.attention_dropout = 0)")
    if sliding_window is not None or softcap is not None:
        raise ValueError(f"{_name(module)}: sliding-window / soft-capped attention is not served by cake gqa")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{_name(module)}: non-causal attention is not served by cake gqa")
    _need_bf16(module, "gqa", query=query, key=key, value=value)
    if attention_mask is not None and (attention_mask.ndim != 2 or attention_mask.shape[1] != kv_len):
        raise ValueError(f"{_name(module)}: cake gqa takes a 2D padding mask over the {kv_len} keys (its own mask "
                         f"function), got shape {tuple(attention_mask.shape)} (a static cache is not served)")
    where = _name(module)
    vq = kwargs.get(VARLEN_KW)
    if vq is None or not vq.fits(batch, seqlen):
        mq = None if attention_mask is None else attention_mask[:, -seqlen:]
        vq = build_varlen(batch, seqlen, query.device, attention_mask=mq, position_ids=kwargs.get("position_ids"),
                          kwargs=kwargs, past_len=kv_len - seqlen, where=where)
    if kv_len == seqlen:
        vk = vq
    else:  # a cache continuation: each row's keys are one document, its queries the last ones
        vk = _rows(batch, kv_len, query.device) if attention_mask is None else _from_mask(attention_mask, query.device)
        if vq.n_docs != batch:
            raise ValueError(f"{where}: a packed batch cannot continue a cache")
    q = vq.gather_heads(query)
    k = vk.gather_heads(key)
    v = vk.gather_heads(value)
    out = _gqa.varlen_gqa_attention(q, k, v, vq.cu_seqlens, vk.cu_seqlens, max_seqlen_k=max(vk.max_seqlen, 1),
                                    softmax_scale=scaling)
    return vq.scatter(out), None


def _project(self, family, h):
    """HF's projections on [1, T, hidden]: (mixed q|k|v [1, T, 2 Hk K + HV V], z [1, T, HV, V], b, a [1, T, HV])."""
    if family.projection == "qkvz":
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(h), self.in_proj_ba(h))
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    mixed = self.in_proj_qkv(h)
    z = self.in_proj_z(h)
    return mixed, z.reshape(z.shape[0], z.shape[1], -1, self.head_v_dim), self.in_proj_b(h), self.in_proj_a(h)


def _gdn_core(self, y, b, a, cu_seqlens, initial_state, output_final_state):
    """conv output y [T, 2 Hk K + HV V] -> (o [1, T, HV, V], final state), GVA native."""
    tokens = y.shape[0]
    kd = self.key_dim
    q = y[:, :kd].view(1, tokens, self.num_k_heads, self.head_k_dim)
    k = y[:, kd:2 * kd].view(1, tokens, self.num_k_heads, self.head_k_dim)
    v = y[:, 2 * kd:].view(1, tokens, self.num_v_heads, self.head_v_dim)
    beta = b.sigmoid()
    # HF's decay, as HF computes it (fp32: with fp16 weights A might be -inf otherwise)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    return _gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=cu_seqlens)


def _prefill(self, hidden_states, cache_params, attention_mask, kwargs, weight, width, project, core, output):
    """A linear-attention layer's forward without a cached state (training, prefill), on the packed kept tokens:
    project(h [1, T, hidden]) -> (conv input [1, T, C], extra), our conv, core(y [T, C], h, extra, cu_seqlens,
    output_final_state) -> (o, state), output(o, h, extra) -> [1, T, hidden]; with a cache, the prefill fills it
    as HF does (each row's last W conv inputs, padding zeroed, and the final state)."""
    batch, seqlen, _ = hidden_states.shape
    vl = kwargs.get(VARLEN_KW)
    if vl is None or not vl.fits(batch, seqlen):
        vl = build_varlen(batch, seqlen, hidden_states.device, attention_mask=attention_mask, kwargs=kwargs,
                          where=_name(self))
    if cache_params is not None and vl.n_docs != batch:
        raise ValueError(f"{_name(self)}: a packed batch ({vl.n_docs} documents in {batch} rows) cannot fill a "
                         "cache; pass use_cache=False")
    h = vl.gather(hidden_states).unsqueeze(0)  # [1, T, hidden]: only the kept tokens
    mixed, extra = project(h)
    y = _conv1d.causal_conv1d(mixed[0], weight, cu_seqlens=vl.cu_seqlens, activation=self.activation)
    o, state = core(y, h, extra, vl.cu_seqlens, cache_params is not None)
    if cache_params is not None:
        cache_params.update_conv_state(vl.scatter(mixed[0]).transpose(1, 2), self.layer_idx, conv_kernel_size=width)
        cache_params.update_recurrent_state(state, self.layer_idx)
    return vl.scatter(output(o, h, extra)[0])


def _linear_forward(op: str, cont, parts):
    """HF's forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs) of a linear-attention
    layer, on our conv and core: bf16 checked; `cont(self, hidden_states, cache_params, attention_mask, weight,
    width)` continues a cached state (decode, chunked prefill); otherwise `_prefill` with `parts(self)` = (project,
    core, output)."""
    from transformers.integrations.accelerate import force_accelerate_hooks

    @force_accelerate_hooks("conv1d")
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        _need_bf16(self, op, hidden_states=hidden_states)
        weight = self.conv1d.weight.squeeze(1)
        width = self.conv_kernel_size
        if cache_params is not None and cache_params.has_previous_state(self.layer_idx):
            return cont(self, hidden_states, cache_params, attention_mask, weight, width)
        return _prefill(self, hidden_states, cache_params, attention_mask, kwargs, weight, width, *parts(self))
    return forward


def make_gdn_forward(family: Family):
    """The GatedDeltaNet forward. Why an override, not HF's chunk_gated_delta_rule / causal_conv1d_fn hooks: HF's
    forward repeats q and k over the value heads before the hook (GVA would cost HV / H x their memory and traffic),
    hands the conv a [B, D, T] transpose, only zeroes padding rows (their tokens still run), and never receives the
    documents of a packed batch given by position ids alone (the decoder does not pass position_ids here). This
    keeps HF's projections, decay math, gated norm (self.norm) and output projection."""

    def parts(self):
        def project(h):
            mixed, z, b, a = _project(self, family, h)
            return mixed, (z, b, a)

        def core(y, h, extra, cu_seqlens, output_final_state):
            return _gdn_core(self, y, extra[1], extra[2], cu_seqlens, None, output_final_state)

        def output(o, h, extra):
            out = self.norm(o[0], extra[0][0])  # [T, HV, V]
            return self.out_proj(out.reshape(1, out.shape[0], -1))
        return project, core, output

    forward = _linear_forward("gdn", lambda self, *args: _gdn_continue(self, family, *args), parts)
    forward.__name__ = f"cake_{family.prefix}GatedDeltaNet_forward"
    return forward


def _zero_padding(hidden_states, attention_mask):
    """As HF before a cached segment: the padding tokens of the new segment zeroed (the mask's last seqlen columns)."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, -hidden_states.shape[1]:, None]).to(hidden_states.dtype)


def _continue_conv(self, mixed, cache_params, weight, width):
    """Our conv of a cached segment: each row of mixed [B, L, C] one document whose conv sees its cached last W
    inputs first (the cache updated as HF does). Returns (y [B L, C] of the new positions, the rows' cu_seqlens
    [B + 1] int32, the cached recurrent state)."""
    batch, seqlen, _ = mixed.shape
    full = cache_params.update_conv_state(mixed.transpose(1, 2), self.layer_idx, conv_kernel_size=width)
    full_len = full.shape[-1]  # cached W + seqlen
    x = full.transpose(1, 2).reshape(batch * full_len, -1)
    rows_full = torch.arange(0, (batch + 1) * full_len, full_len, dtype=torch.int32, device=x.device)
    y = _conv1d.causal_conv1d(x, weight, cu_seqlens=rows_full, activation=self.activation)
    y = y.view(batch, full_len, -1)[:, -seqlen:].reshape(batch * seqlen, -1)
    rows = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=x.device)
    return y, rows, cache_params.layers[self.layer_idx].recurrent_states[0]


def _gdn_continue(self, family, hidden_states, cache_params, attention_mask, weight, width):
    """A forward continuing a cached state (decode, chunked prefill): each row is one document whose conv sees the
    cached last W inputs first and whose core starts from the cached recurrent state (HF's semantics, our ops)."""
    batch, seqlen, _ = hidden_states.shape
    hidden_states = _zero_padding(hidden_states, attention_mask)
    mixed, z, b, a = _project(self, family, hidden_states)
    y, rows, state0 = _continue_conv(self, mixed, cache_params, weight, width)
    o, state = _gdn_core(self, y, b.reshape(1, batch * seqlen, -1), a.reshape(1, batch * seqlen, -1), rows,
                         state0, True)
    cache_params.update_recurrent_state(state, self.layer_idx)
    out = self.norm(o[0], z.reshape(batch * seqlen, *z.shape[2:]))
    return self.out_proj(out.reshape(batch, seqlen, -1))


def _kda_core(self, y, h, cu_seqlens, initial_state, output_final_state):
    """Kimi-Linear's KDA core on the conv output y [T, 3 H K] and the layer input h [1, T, hidden] (for the gates):
    (o [1, T, H, V], final state). The forget gate runs in the kernel (`use_gate_in_kernel`): the raw
    f_b_proj(f_a_proj(h)), A_log and dt_bias, so their gradients come back through chunk_kda; beta as HF's."""
    tokens, d = y.shape[0], self.qkv_dim
    shape = (1, tokens, self.num_heads, self.head_dim)
    q, k, v = (y[:, i * d:(i + 1) * d].view(shape) for i in range(3))
    fg = self.forget_gate
    g = fg.f_b_proj(fg.f_a_proj(h)).view(shape)
    beta = torch.sigmoid(self.b_proj(h))
    return _kda.chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=fg.A_log.float().reshape(-1),
                          dt_bias=fg.dt_bias.float(), cu_seqlens=cu_seqlens)


def _kda_output(self, o, h):
    """HF's output gate, sigmoid-gated norm and output projection: o [1, T, H, V], h [1, T, hidden] -> [1, T,
    hidden]."""
    gate = self.g_b_proj(self.g_a_proj(h)).view(o.shape)
    out = self.o_norm(o[0], gate[0])
    return self.o_proj(out.reshape(1, out.shape[0], -1))


def _kda_mixed(self, h):
    return torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)


def make_kda_forward(family: Family):
    """The KDA layer's forward. Why an override: HF's forward runs padding tokens and hands its conv / KDA hooks
    neither the documents of a position-ids-only packed batch nor (its torch fallbacks) any documents at all. This
    keeps HF's projections, output gate, sigmoid-gated norm and output projection; conv and core are ours."""

    def parts(self):
        return (lambda h: (_kda_mixed(self, h), None),
                lambda y, h, extra, cu_seqlens, keep: _kda_core(self, y, h, cu_seqlens, None, keep),
                lambda o, h, extra: _kda_output(self, o, h))

    forward = _linear_forward("kda", _kda_continue, parts)
    forward.__name__ = f"cake_{family.prefix}{family.linear}_forward"
    return forward


def _kda_continue(self, hidden_states, cache_params, attention_mask, weight, width):
    """A forward continuing a cached state (decode, chunked prefill): each row one document, its conv over the
    cached last W inputs first, its core from the cached recurrent state (HF's semantics, our ops)."""
    batch, seqlen, _ = hidden_states.shape
    hidden_states = _zero_padding(hidden_states, attention_mask)
    y, rows, state0 = _continue_conv(self, _kda_mixed(self, hidden_states), cache_params, weight, width)
    h = hidden_states.reshape(1, batch * seqlen, -1)
    o, state = _kda_core(self, y, h, rows, state0, True)
    cache_params.update_recurrent_state(state, self.layer_idx)
    return _kda_output(self, o, h).reshape(batch, seqlen, -1)


def gated_norm_forward(self, hidden_states, gate):
    """`*RMSNormGated`: rmsnorm_silu_gate(x, z, w) (fp32 math; HF rounds the normalised x to bf16 before * w)."""
    _need_bf16(self, "gated_rmsnorm", hidden_states=hidden_states, gate=gate)
    return _gated.rmsnorm_silu_gate(hidden_states, gate, self.weight, self.variance_epsilon)


def norm_forward(self, x):
    """Zero-centred `*RMSNorm`: zero_centered_rmsnorm(x, w) = x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    _need_bf16(self, "rmsnorm", x=x)
    return _rmsnorm.zero_centered_rmsnorm(x, self.weight, self.eps)


def make_text_forward(family: Family, original):
    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        parts = _merged(self.__dict__.get("_cake_parts"), _CLASS_PARTS.get(family.key))
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref is not None and parts.any_varlen():
            if parts.attention and self.config._attn_implementation != ATTN:
                self.set_attn_implementation(ATTN)  # a class patch: models built before or without it
            if self.__dict__.get("_cake_checked") != parts.key():
                _check_model(self, family, parts)
            batch, seqlen = ref.shape[0], ref.shape[1]
            past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
            where = f"{type(self).__name__}.forward"
            vl = build_varlen(batch, seqlen, ref.device, attention_mask=attention_mask, position_ids=position_ids,
                              kwargs=kwargs, past_len=past_len, where=where)
            if vl.n_docs != batch:
                impl = self.config._attn_implementation
                if "attention" not in family.served and impl not in VARLEN_ATTENTION and "full_attention" in set(
                        getattr(self.config, "layer_types", None) or ()):
                    raise ValueError(f"{where}: a packed batch ({vl.n_docs} documents in {batch} row(s)) reaches this "
                                     f"model's full-attention layers, which cake does not serve and HF's {impl!r} "
                                     "attention would run across documents; load the model with "
                                     "attn_implementation='flash_attention_2' or pass a padded batch")
                if past_key_values is not None or use_cache:
                    raise ValueError(f"{where}: a packed batch ({vl.n_docs} documents in {batch} row(s)) cannot fill "
                                     "or continue a cache; pass use_cache=False")
                use_cache = False  # HF's default (config.use_cache) would build a cache nothing can use
            kwargs[VARLEN_KW] = vl
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    return forward


# ---------------------------------------------------------------------------------------------------------------
# applying
def register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTN, attention_forward)
    AttentionMaskInterface.register(ATTN, flash_attention_mask)  # 2D padding mask or None, as FA2 gets


def _tagged(fn, label):
    setattr(fn, _TAG, label)
    return fn


def _pieces(family: Family, parts: Parts):
    """(class, entry points, check, forward factory) of each requested piece."""
    c = family.classes()
    out = []
    if parts.linear_attention and family.projection == "kda":
        out.append((c.linear, "chunk_kda + causal_conv1d", check_kda, lambda: make_kda_forward(family)))
    elif parts.linear_attention:
        out.append((c.linear, "chunk_gated_delta_rule + causal_conv1d", check_gdn, lambda: make_gdn_forward(family)))
    if parts.norms:
        out.append((c.gated_norm, "rmsnorm_silu_gate", check_gated_norm, lambda: gated_norm_forward))
        out.append((c.norm, "zero_centered_rmsnorm", check_norm, lambda: norm_forward))
    return c, out


def _check_model(text_model, family, parts):
    """Static checks of every module a forward of this text model will send to the ops (names set on the modules)."""
    c, pieces = _pieces(family, parts)
    checks = [(cls, check) for cls, _, check, _ in pieces]
    if parts.attention:
        checks.append((c.attention, check_attention))
    for name, m in text_model.named_modules():
        for cls, check in checks:
            if type(m) is cls:
                if not getattr(m, "_cake_name", None):
                    m._cake_name = name or type(m).__name__
                check(m)
    text_model._cake_checked = parts.key()


def apply(family_key: str, model=None, *, attention=True, linear_attention=True, norms=True):
    family = FAMILIES[family_key]
    try:
        c = family.classes()
    except (ImportError, AttributeError) as e:
        raise ImportError(f"{family.apply_name}: this transformers has no {family.prefix} models ({e}); "
                          "pip install 'miles_ext_kernels[hf]'") from None
    want = Parts(bool(attention), bool(linear_attention), bool(norms))
    for part in ("attention", "linear_attention", "norms"):
        if getattr(want, part) and part not in family.served:
            raise ValueError(f"{family.apply_name}: {part}={getattr(want, part)!r}: no cake op serves "
                             f"{family.prefix}'s {part.replace('_', ' ')} (served: {', '.join(family.served)})")
    if want.attention:
        register_attention()
    return _apply_classes(family, c, want) if model is None else _apply_instance(family, c, model, want)


def _apply_classes(family, c, want):
    have = _CLASS_PARTS.setdefault(family.key, Parts())
    new = Parts(want.attention and not have.attention, want.linear_attention and not have.linear_attention,
                want.norms and not have.norms)
    report: dict[str, list[str]] = {}
    if not (new.attention or new.linear_attention or new.norms):
        return report
    _, pieces = _pieces(family, new)
    for cls, entry, _, factory in pieces:
        _set_class_attr(cls, "forward", _tagged(factory(), entry))
        report.setdefault(entry, []).append(cls.__name__)
    if new.attention:
        report["varlen_gqa_attention"] = [f"{c.attention.__name__} (attn_implementation={ATTN!r})"]
    tm = c.text_model
    if not getattr(tm.forward, _TAG, None):
        _set_class_attr(tm, "forward", _tagged(make_text_forward(family, tm.forward), "varlen"))
    have.attention |= new.attention
    have.linear_attention |= new.linear_attention
    have.norms |= new.norms
    return report


def _set_class_attr(cls, attr, fn):
    _ORIGINALS.setdefault((cls, attr), cls.__dict__[attr])
    setattr(cls, attr, fn)


def _revert_classes(family_key=None):
    """Put HF's class attributes back (tests; models patched per instance keep their patches)."""
    for (cls, attr), original in list(_ORIGINALS.items()):
        if family_key is None or cls.__module__ == FAMILIES[family_key].module:
            setattr(cls, attr, original)
            del _ORIGINALS[(cls, attr)]
    for key in list(_CLASS_PARTS):
        if family_key is None or key == family_key:
            del _CLASS_PARTS[key]


def _apply_instance(family, c, model, want):
    text_models = [m for m in model.modules() if isinstance(m, c.text_model)]
    if not text_models:
        raise ValueError(f"{family.apply_name}: {type(model).__name__} contains no {c.text_model.__name__}")
    _, pieces = _pieces(family, want)
    # check everything first: nothing is patched when one module is not served
    todo = []
    for tm in text_models:
        prefix = "" if tm is model else next(n for n, m in model.named_modules() if m is tm) + "."
        for name, m in tm.named_modules():
            for cls, entry, check, factory in pieces:
                if type(m) is cls:
                    if not getattr(m, "_cake_name", None):
                        m._cake_name = (prefix + name).rstrip(".") or type(m).__name__
                    check(m)
                    if not getattr(m.__dict__.get("forward"), _TAG, None) and not getattr(cls.forward, _TAG, None):
                        todo.append((m, entry, factory))
            if want.attention and type(m) is c.attention:
                m._cake_name = getattr(m, "_cake_name", None) or (prefix + name)
                check_attention(m)
    report: dict[str, list[str]] = {}
    for m, entry, factory in todo:
        m.forward = types.MethodType(_tagged(factory(), entry), m)
        report.setdefault(entry, []).append(m._cake_name)
    for tm in text_models:
        parts = tm.__dict__.get("_cake_parts")
        if parts is None:
            parts = tm._cake_parts = Parts()
            if not getattr(type(tm).forward, _TAG, None):
                tm.forward = types.MethodType(_tagged(make_text_forward(family, type(tm).forward), "varlen"), tm)
        if want.attention and tm.config._attn_implementation != ATTN:
            tm.set_attn_implementation(ATTN)
            names = [getattr(m, "_cake_name", "") for m in tm.modules() if type(m) is c.attention]
            report.setdefault("varlen_gqa_attention", []).extend(names)
        parts.attention |= want.attention
        parts.linear_attention |= want.linear_attention
        parts.norms |= want.norms
    return report
