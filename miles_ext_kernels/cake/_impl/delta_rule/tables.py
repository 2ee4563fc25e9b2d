"""The launch-config table the delta-rule ops start from, torch-free: gdn's table, swept at the shape of record
on an H200 (sm_90a; see `_impl/gdn/configs.py` for what each entry means and how it was chosen). kda's table is
this one with the entries its per-key-dimension gate needs changed (`_impl/kda/configs.py`). Each op's configs
module holds its own copy: a test that patches one op's table leaves the other's alone."""

SWEPT = {
    "l2norm": dict(num_warps=4, BR=16),
    "prep": dict(num_warps=2),
    "wu": dict(num_warps=4),
    "h": dict(num_warps=8, num_stages=3, BV=128),
    "h_narrow": dict(num_warps=4, num_stages=3, BV=32),
    "o": dict(num_warps=4),
    "dvl": dict(num_warps=4),
    "dh": dict(num_warps=8, num_stages=1, BV=128),
    "dh_narrow": dict(num_warps=4, num_stages=2, BV=32),
    "dqkw": dict(num_warps=4, BK=128, SPLIT=True, num_warps_dk=4, BK_dk=128),
    "wy": dict(num_warps=4),
    "final": dict(num_warps=4, BR=16, LOW_PARTIALS=True, LOW_DK=True),
}
NARROW_BELOW = 128  # programs of the wide state tiles under which h_narrow / dh_narrow are used
DEFAULT_STAGES = 2  # num_stages where an entry has none (the chunk kernels have no pipelined loop)


def table(**entries) -> dict:
    """A fresh copy of SWEPT (each entry its own dict), with `entries` replacing or adding whole entries."""
    return {name: dict(entry) for name, entry in {**SWEPT, **entries}.items()}


def per_arch(cfg: dict) -> dict:
    """The table of each arch the ops serve; the interpreter (CPU tests) runs the same table."""
    return {"sm_90a": cfg, "interpreter": cfg}
