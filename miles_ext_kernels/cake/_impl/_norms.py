"""What the two norms (rmsnorm, gated_rmsnorm) share: dtypes, the weight / eps checks, the config table a call runs,
the det weight gradient's scratch and second stage, routes() over every flag, accuracy budgets and the demo loop.

Both norms: bf16 rows, an fp32 or bf16 weight whose gradient comes in its own dtype, a forward of one tile of rows
per program, and a persistent backward (programs = SMs x a per-SM count of the table, fixed per arch) whose fp32
partial weight-gradient rows are summed in a fixed order (`_runtime.reduce`).
"""
from __future__ import annotations

from typing import Callable

import torch

from miles_ext_kernels.cake._runtime import build, checks
from miles_ext_kernels.cake._runtime import reduce as _reduce
from miles_ext_kernels.cake._runtime.launch import collect_routes, launch
from miles_ext_kernels.cake._runtime.operands import operand

X_DTYPES = (torch.bfloat16,)
W_DTYPES = (torch.float32, torch.bfloat16)
VARIANTS = ("det", "fast")

# The arch whose table (configs and SM count) a call runs: the interpreter (CPU tests) runs Hopper's, so CPU tests
# run the shipped configs and program counts.
TABLE_ARCH = {"sm_90a": "sm_90a", build.INTERPRETER_ARCH: "sm_90a"}


def table_configs(table: _reduce.RowConfigs, width: int, rows: int, arch: str) -> tuple:
    """(forward config, backward config, backward programs) of a call for `arch` (`launch.arch_of` of its x: a meta
    tensor inside `collect_routes` gets the planned arch). The program count is the table arch's SM count (132 on
    sm_90a) times the table's per-SM count, never the live device's, so it is the same for meta tensors and real
    ones."""
    return table(width, rows, TABLE_ARCH[arch])


def check_weight_and_eps(named: list, weight, eps, width: int, width_name: str, check_supported: Callable) -> None:
    """The checks after an op's own checks of its row operands `named` ([(name, tensor)], x first): the weight
    (`[width]`, fp32 or bf16), one device, eps, and the width (`check_supported` of the op's declaration)."""
    checks.check_tensor("weight", weight, dtype=W_DTYPES, ndim=1)
    if weight.shape[0] != width:
        raise ValueError(f"weight has {weight.shape[0]} elements but {width_name} is {width}")
    checks.check_same_device([*named, ("weight", weight)])
    checks.check_eps(eps)
    try:
        check_supported(width)
    except ValueError as e:
        raise ValueError(f"x's last dimension: {e}") from None


def check_dy(dy, x) -> None:
    checks.check_tensor("dy", dy, dtype=X_DTYPES)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")


def aligned_contiguous(t: torch.Tensor) -> bool:
    """Whether `t` is contiguous and starts 16-byte aligned: then `operands.operand` would read it in place, and the
    launchers skip its generic checks (~3 us of host time per operand, as much as the rest of a launcher)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def weight_operand(weight: torch.Tensor, op: str) -> torch.Tensor:
    """The weight as the kernels read it: in place when its stride is 1 and it starts 16-byte aligned, else a
    counted contiguous copy (`operands.operand`)."""
    return weight if aligned_contiguous(weight) else operand(weight, op, "weight")


def zero_weight_grad(weight: torch.Tensor) -> torch.Tensor:
    """The weight gradient of a call with no rows."""
    return torch.zeros_like(weight, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------------------
# the det weight gradient: fp32 partial rows, summed in a fixed order
def partial_rows(op: str, n: int, like: torch.Tensor) -> torch.Tensor:
    """fp32 scratch of `n` elements for partial rows on `like`'s device (`_runtime.reduce.partial_rows`; a meta
    tensor for a meta `like`, kept out of the workspace pool)."""
    if like.is_meta:
        return torch.empty(n, dtype=torch.float32, device="meta")
    return _reduce.partial_rows(op, n, like.device)


def counters(x: torch.Tensor) -> torch.Tensor:
    """The zeroed int32 counters of a `fixed_order_finish` launch on `x`'s device and stream; a fresh meta array for
    a meta `x` (the runtime caches counters by device index, which a meta tensor shares with CPU tensors)."""
    if x.is_meta:
        return torch.zeros(_reduce.COUNTER_SLOTS, dtype=torch.int32, device="meta")
    return _reduce.counters(x)


def reduce_columns(part: torch.Tensor, P: int, N: int, out: torch.Tensor) -> torch.Tensor:
    """out[:N] = `part` viewed as `[P, N]` fp32 rows, summed over its rows in a fixed order: the launch of
    `_runtime.reduce.reduce_columns`, through `launch` so that routes() records it."""
    launch(_reduce._reduce_columns_kernel, (build.cdiv(N, _reduce.BLOCK_N),), part_ptr=part, out_ptr=out, P=P, N=N,
           BLOCK_P=_reduce.BLOCK_P, BLOCK_N=_reduce.BLOCK_N, num_warps=_reduce.NUM_WARPS, num_stages=1)
    return out


# ----------------------------------------------------------------------------------------------------------------
def routes(rows_by_window: dict, run: Callable) -> list:
    """The routes of `run(weight dtype, rows, variant)` (an op's forward and backward launchers on meta tensors of
    `rows` rows), recorded over both weight dtypes, one row count per token-count window and both variants."""
    arch = build.INTERPRETER_ARCH if build.INTERPRET else build.device_arch()
    with collect_routes(arch) as rs:
        for wdt in W_DTYPES:
            for rows in rows_by_window.values():
                for variant in VARIANTS:
                    run(wdt, rows, variant)
    return rs.routes


# ----------------------------------------------------------------------------------------------------------------
# Accuracy budgets (relative RMS vs FP64), from our H200 run (bench/results/norms.json, 8k tokens):
# - bf16 outputs: ours 1.66e-3 = the peers' (Liger / fla / eager: same fp32 math, one rounding to bf16), so
#   min(peer x 1.1, 2 x ours) = 1.83e-3 on the GPU for tensors of >= 65536 elements; smaller tensors (too few
#   elements for that statistic) get one bf16 ulp-level error, 2^-8. Triton's interpreter truncates fp32 -> bf16
#   instead of rounding (measured ~3.3e-3 on CPU): 2^-7 there.
# - fp32 weight gradients: fp32 summation, measured <= 1.75e-7 (GPU and CPU): budget 3.5e-7 = 2 x ours (the peers
#   measured 1.6e-7 .. 1.75e-7 on the bench shapes).
# - bf16 weight gradients: one rounding of the fp32 sum, measured <= 1.76e-3 on the GPU: 3.5e-3 (2^-7 on CPU).
BF16_BUDGET = {"cuda": 1.83e-3, "cpu": 2.0 ** -7}
SMALL_BF16_BUDGET = {"cuda": 2.0 ** -8, "cpu": 2.0 ** -7}
BF16_DW_BUDGET = {"cuda": 3.5e-3, "cpu": 2.0 ** -7}
FP32_DW_BUDGET = 3.5e-7


def budgets(device: str, wdtype: torch.dtype, numel: int, outputs: tuple) -> dict:
    """{tensor: budget}: the bf16 `outputs` (y and the row gradients) and dw."""
    kind = "cpu" if str(device).startswith("cpu") else "cuda"
    b = (BF16_BUDGET if numel >= 65536 else SMALL_BF16_BUDGET)[kind]
    out = {k: b for k in outputs}
    out["dw"] = FP32_DW_BUDGET if wdtype == torch.float32 else BF16_DW_BUDGET[kind]
    return out


def demo_rows(op: str, device: str, cases: list, run_case: Callable) -> list[dict]:
    """Each case of both variants against the FP64 reference: `run_case(case, generator)` -> (label, got, ref,
    budgets), `got` / `ref` / `budgets` keyed by tensor name. One row per tensor."""
    from miles_ext_kernels import configure
    from miles_ext_kernels.cake._runtime.testing import rel_rms

    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for variant in VARIANTS:
            configure(**{f"{op}_variant": variant})
            for case in cases:
                label, got, ref, bud = run_case(case, gen)
                for k in got:
                    err = rel_rms(got[k], ref[k])
                    rows.append({"op": op, "case": f"{variant} {label}", "tensor": k, "err": err, "budget": bud[k],
                                 "ok": err <= bud[k]})
    finally:
        configure()
    return rows
