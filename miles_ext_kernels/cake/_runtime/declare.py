"""What several op declarations (`cake/<op>.py`) share, torch-free: the host checks of their `check_supported`, the
`check_seqlens` option and the spec of a chunked delta-rule op (gdn, kda)."""
from __future__ import annotations

from .spec import Flag, OpSpec


def check_counts(names_and_values, prefix: str = "") -> None:
    """Each (name, value) a host int >= 1: TypeError / ValueError naming it (after `prefix`) otherwise."""
    for name, value in names_and_values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{prefix}{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{prefix}{name} must be >= 1, got {value}")


def check_seqlens_flag(op: str, what: str = "cu_seqlens",
                       detail: str = ": starts at 0, never decreases, ends exactly at T") -> Flag:
    """The `check_seqlens` option of `op`: check `what` on the host before each call."""
    return Flag("check_seqlens", f"{op}: check {what} on the host before each call (one device sync per call){detail}")


def delta_rule_spec(name: str, selector: tuple[str, str], entry_point: str, options: tuple = ()) -> OpSpec:
    """The spec of a chunked delta-rule op: det and fast, selected by `selector`, its `options` then
    `check_seqlens`, prebuilt per (head_k_dim, head_v_dim)."""
    return OpSpec(name, selected_by=(selector,), entry_points=(entry_point,),
                  options=tuple(options) + (check_seqlens_flag(name),), prebuild_params=("head_k_dim", "head_v_dim"))


def check_delta_rule_heads(op: str, head_dims, head_k_dim, head_v_dim, num_k_heads, num_v_heads) -> None:
    """A delta-rule op's check_supported: head dims in `head_dims`, num_v_heads a multiple of num_k_heads."""
    check_counts((("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("num_k_heads", num_k_heads),
                  ("num_v_heads", num_v_heads)))
    for name, value in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if value not in head_dims:
            raise ValueError(f"{op}: {name}={value} is not served (served: {head_dims})")
    if num_v_heads % num_k_heads:
        raise ValueError(f"{op}: num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
