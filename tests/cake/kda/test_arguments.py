"""kda declaration and command-line flags (torch-free; check_supported: tests/cake/test_delta_rule_arguments.py),
and bad operands rejected before any launch."""

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels.cake import kda
from tests.cake._cli import assert_cli_option, parse_validated
from tests.cake._helpers import assert_declared, assert_import_is_torch_free, assert_raises_before_launch


def test_declaration():
    op = kda.OP
    assert_declared(op, "kda", "kda_backend", ("chunk_kda",), ("head_k_dim", "head_v_dim"))
    flag = op.option("check_seqlens")
    assert flag.is_bool and flag.default is False
    assert [f.name for f in op.options] == ["check_seqlens"]


def test_import_is_torch_free():
    assert_import_is_torch_free("miles_ext_kernels.cake.kda", "m.check_supported(128, 128, 32, 32)")


def test_cli_defaults_option_and_deterministic_mode():
    assert_cli_option("kda", ("--kda-backend", "cake"), "check_seqlens", False, ("--cake-kda-check-seqlens",), True)
    assert parse_validated("--kda-backend", "cake", "--deterministic-mode").cake_kda_variant == "det"
    with pytest.raises(ValueError):
        parse_validated("--cake-kda-check-seqlens")  # an option without its selector
    with pytest.raises(ValueError):
        mek.configure(deterministic_mode=True, kda_variant="fast")


# ----------------------------------------------------------------------------------------------------------------
# bad operands: ValueError / TypeError naming the argument, before any launch (the launcher is replaced by a failure)
torch = pytest.importorskip("torch")


def _args(T=8, H=1, HV=2, K=16, V=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, K, generator=g).to(torch.bfloat16)
    return dict(q=q, k=q.clone(), v=torch.randn(1, T, HV, V, generator=g).to(torch.bfloat16),
                g=torch.zeros(1, T, HV, K) - 0.1, beta=torch.rand(1, T, HV, generator=g))


def _gated():
    return dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(32))


BF = torch.bfloat16


def _wide(heads, dim, T=2 ** 24, dtype=BF):
    """A [1, T, heads, dim] operand of T tokens that holds one token's memory (a zero-stride view)."""
    return torch.zeros(1, 1, heads, dim, dtype=dtype).expand(1, T, heads, dim)


BAD = [
    (dict(cp_context=object()), TypeError, "cp_context"),
    (dict(q=torch.randn(1, 8, 1, 16)), TypeError, "^q must be bfloat16"),
    (dict(k=torch.randn(1, 8, 1, 16).to(BF)[:, :4]), ValueError, "^k must have the shape of q"),
    (dict(q=torch.randn(1, 8, 2, 16).to(BF), k=torch.randn(1, 8, 2, 16).to(BF), v=torch.randn(1, 8, 3, 16).to(BF)),
     ValueError, "HV=3 must be a positive multiple"),
    (dict(v=torch.randn(1, 7, 2, 16).to(BF)), ValueError, "^v must be"),
    (dict(q=torch.randn(1, 8, 1, 24).to(BF), k=torch.randn(1, 8, 1, 24).to(BF)), ValueError, "K=24"),
    (dict(v=torch.randn(1, 8, 2, 48).to(BF)), ValueError, "V=48"),
    (dict(g=torch.zeros(1, 8, 2)), ValueError, r"^g must have 4 dimensions"),
    (dict(g=torch.zeros(1, 8, 2, 8)), ValueError, r"^g must be \[B, T, HV, K\]"),
    (dict(g=torch.zeros(1, 8, 2, 16, dtype=BF)), TypeError, "^g must be float32"),  # a log decay: fp32
    (dict(g=torch.zeros(1, 8, 2, 16, dtype=torch.float16), **_gated()), TypeError, "^g must be"),
    (dict(beta=torch.zeros(1, 8, 2, dtype=torch.int32)), TypeError, "^beta must be"),
    (dict(beta=torch.zeros(1, 8, 1)), ValueError, r"^beta must be \[B, T, HV\]"),
    (dict(use_gate_in_kernel=True, dt_bias=torch.zeros(32)), ValueError, "^A_log is required"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2)), ValueError, "^dt_bias is required"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3), dt_bias=torch.zeros(32)), ValueError, r"^A_log must be \[2\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2, 16)), ValueError,
     r"^dt_bias must be \[32\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2, dtype=BF), dt_bias=torch.zeros(32)), TypeError,
     "^A_log must be float32"),
    (dict(A_log=torch.zeros(2)), ValueError, "^A_log is read only by the in-kernel gate"),
    (dict(dt_bias=torch.zeros(32)), ValueError, "^dt_bias is read only by the in-kernel gate"),
    (dict(safe_gate=True, **_gated()), ValueError, "^lower_bound is required"),
    (dict(safe_gate=True, lower_bound=-6.0, **_gated()), ValueError, r"^lower_bound must lie in \[-5, 0\)"),
    (dict(safe_gate=True, lower_bound=0.0, **_gated()), ValueError, "^lower_bound must be a finite float < 0"),
    (dict(lower_bound=float("nan"), **_gated()), ValueError, "^lower_bound must be a finite float < 0"),
    (dict(lower_bound="x"), TypeError, "^lower_bound must be a float"),
    (dict(safe_gate=1), TypeError, "^safe_gate must be a bool"),
    (dict(use_gate_in_kernel=None), TypeError, "^use_gate_in_kernel must be a bool"),
    (dict(transpose_state_layout="yes"), TypeError, "^transpose_state_layout must be a bool"),
    (dict(output_final_state=1), TypeError, "^output_final_state must be a bool"),
    (dict(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.float32)), TypeError, "^cu_seqlens must be"),
    (dict(cu_seqlens=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "^cu_seqlens must rise"),
    (dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 2, 16, 16)), ValueError,
     r"^initial_state must be \[N, HV, K, V\]"),
    (dict(initial_state=torch.zeros(1, 2, 16, 32), v=torch.randn(1, 8, 2, 32).to(BF), transpose_state_layout=True),
     ValueError, r"^initial_state must be \[N, HV, V, K\]"),
    (dict(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.int32)), TypeError, "^initial_state must be"),
    (dict(scale="x"), TypeError, "^scale must be a float"),
    (dict(scale=float("inf")), ValueError, "^scale must be finite"),
    (dict(v=torch.zeros(1, 8, 2, 16, dtype=BF, device="meta")), ValueError, "^v is on meta but q is on cpu"),
    (dict(g=torch.zeros(1, 8, 2, 16, device="meta")), ValueError, "^g is on meta but q is on cpu"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2, device="meta"), dt_bias=torch.zeros(32)), ValueError,
     "^A_log is on meta"),
    (dict(cu_seqlens=torch.tensor([0, 8], device="meta")), ValueError, "^cu_seqlens is on meta but q is on cpu"),
    (dict(initial_state=torch.zeros(1, 2, 16, 16, device="meta")), ValueError, "^initial_state is on meta"),
    # 2**24 tokens x HV 2 x 64 (the chunk): per-token buffers past 32-bit offsets (zero-stride views, no memory)
    (dict(q=_wide(1, 16), k=_wide(1, 16), v=_wide(2, 16), g=_wide(2, 16, dtype=torch.float32),
          beta=_wide(2, 1, dtype=torch.float32)[..., 0]), ValueError, r"^q holds B \* T = 16777216 tokens"),
]


@pytest.mark.parametrize("change, exc, word", BAD, ids=[f"{i}-{c[2][:24]}" for i, c in enumerate(BAD)])
def test_bad_operands_raise_before_launch(change, exc, word, monkeypatch):
    import importlib

    from miles_ext_kernels.cake._runtime import varlen

    ops = importlib.import_module("miles_ext_kernels.cake._impl.kda.ops")
    core = importlib.import_module("miles_ext_kernels.cake._impl.delta_rule.launchers")
    for mod in (ops, core, varlen):  # every launch of a kda call goes through one of these names
        monkeypatch.setattr(mod, "launch", lambda *a, **k: pytest.fail("launched"))
    assert_raises_before_launch(kda.chunk_kda, _args(), change, exc, word, ("q", "k", "v", "g", "beta"))
