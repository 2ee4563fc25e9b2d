"""The one argument surface of the library: miles' command line and direct `configure(...)` calls. Torch-free.

Rules (DESIGN.md, "Configuration rules"):
- `add_arguments(parser)` adds each op's selector (unless miles did), `--cake-<op>-variant` (hidden when the op
  offers one CLI variant), the op's options, `--cake-workspace-pool-bytes`, and `--deterministic-mode` unless the
  parser already has it. It never adds a flag the parser already has; where the parser has one of our flags under
  another `dest` (e.g. `--deterministic-mode` stored as `args.det`), that dest is what `validate_args` and
  `configure(args)` read (the mapping travels on the parsed args as `args.cake_flag_dests`).
- `validate_args(args)` resolves the variant of each *selected* op and writes it back onto `args`: an explicit
  variant is kept; none → `fast` (miles' command-line default), or `det` under deterministic mode; explicit `fast`
  under deterministic mode → ValueError; an op without `det` under deterministic mode → ValueError. Options (or a
  variant) given for an op that is not selected → ValueError. A selector value that differs from the one that
  selects the op only in case or surrounding blanks (`--full-attention-backend Cake`) → ValueError naming the
  flag (selector values are case-sensitive; a silent near miss would leave the op unselected). Then each selected
  op's own `validate(args)`.
- `configure(args=None, *, deterministic_mode=False, workspace_pool_bytes=0, **per_op)` replaces the whole
  configuration; `configure()` resets to defaults. A process that never configured an op runs `det` where the op
  has it. `configure(args)` applies the checks of `validate_args` that need no write-back (a variant or option of
  an unselected op, a near-miss selector value), so nothing it is given is dropped silently; a dict is refused
  (TypeError: pass keywords, `configure(**d)`). An unknown keyword is a TypeError that suggests the closest valid
  one (`gqa_varient` → `gqa_variant`).
- Implementations call `variant(op)` / `option(op, name)` when a call runs. Under
  `torch.use_deterministic_algorithms(True)` a configured `fast` runs `det` (logged once per op).
"""
from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Mapping
from typing import Any

from . import registry
from .spec import OpSpec

log = logging.getLogger("miles_ext_kernels")

POOL_FLAG = "--cake-workspace-pool-bytes"
DET_FLAG = "--deterministic-mode"


# set on the parser (argparse defaults travel onto the parsed args): {our dest: the dest the parser stores the
# flag under}, for each of our flags the parser already had under another dest
FLAG_DESTS = "cake_flag_dests"


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _dest_of(args, dest: str) -> str:
    """Where parsed `args` hold the value of our flag `dest` (another dest when the parser already had the flag)."""
    aliases = getattr(args, FLAG_DESTS, None)
    if isinstance(aliases, Mapping):
        return aliases.get(dest, dest)
    return dest


def _get(args, dest: str, default=None):
    return getattr(args, _dest_of(args, dest), default)


def _set(args, dest: str, value) -> None:
    setattr(args, _dest_of(args, dest), value)


def _check_args(fn: str, args) -> None:
    """miles' parsed args: an argparse.Namespace or any object with attributes (a typed configuration)."""
    if args is None or isinstance(args, (Mapping, str, bytes, int, float, list, tuple, set)):
        hint = ""
        if isinstance(args, Mapping):
            hint = (" (for a dict of keywords call configure(**d))" if fn == "configure" else
                    " (wrap a dict as argparse.Namespace(**d))")
        raise TypeError(f"{fn}() takes miles' parsed args (an argparse.Namespace or an object with attributes), got "
                        f"{type(args).__name__}{hint}")


def variant_dest(op: str) -> str:
    return f"cake_{op}_variant"


def option_dest(op: str, name: str) -> str:
    return f"cake_{op}_{name}"


def option_flag(op: str, name: str) -> str:
    return f"--cake-{_dash(op)}-{_dash(name)}"


# --------------------------------------------------------------------------------------------------------------
# configuration state: replaced as a whole by configure(); read on every call
class _State:
    __slots__ = ("deterministic_mode", "pool_bytes", "variants", "options", "explicit")

    def __init__(self, deterministic_mode=False, pool_bytes=0):
        self.deterministic_mode = deterministic_mode
        self.pool_bytes = pool_bytes
        self.variants: dict[str, str] = {}  # op -> resolved variant (configured ops only)
        self.options: dict[tuple[str, str], Any] = {}  # (op, name) -> value
        self.explicit: set[str] = set()


_state = _State()
_logged_downgrade: set[str] = set()


def _deterministic_mode(args) -> bool:
    """miles keeps `deterministic_mode` flat on its args; a typed configuration object carries it as an attribute
    too (Megatron's TransformerConfig): accept `args.deterministic_mode` (or the dest the parser stores
    `--deterministic-mode` under), else `args.<config>.deterministic_mode`."""
    value = _get(args, "deterministic_mode")
    if value is None:
        for name in ("config", "transformer_config", "model_config"):
            value = getattr(getattr(args, name, None), "deterministic_mode", None)
            if value is not None:
                break
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"deterministic_mode must be a bool, got {type(value).__name__}")
    return value


def _check_pool_bytes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"workspace_pool_bytes must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"workspace_pool_bytes must be >= 0, got {value}")
    return value


def _resolve_variant(spec: OpSpec, given: str | None, deterministic: bool, *, from_cli: bool) -> str:
    allowed = spec.cli_variants if from_cli else spec.variants
    where = f"--cake-{_dash(spec.name)}-variant" if from_cli else f"{spec.name}_variant"
    if given is not None and given not in allowed:
        near = [v for v in allowed if isinstance(given, str) and given.strip().casefold() == v]
        hint = f" (did you mean {near[0]!r}? variant names are lower case)" if near else ""
        raise ValueError(f"{where} must be one of {allowed}, got {given!r}{hint}")
    if deterministic:
        if "det" not in spec.variants:
            raise ValueError(
                f"op {spec.name!r} has no det variant (it ships {spec.variants}), so it cannot run under "
                f"--deterministic-mode; select another backend for it"
            )
        if given == "fast":
            raise ValueError(f"{where}=fast contradicts --deterministic-mode (op {spec.name!r}); use det or drop one")
        return "det"
    if given is not None:
        return given
    if from_cli:  # miles' command-line default is speed
        return "fast" if "fast" in spec.cli_variants else spec.cli_variants[0]
    return spec.default_variant


def _is_selected(spec: OpSpec, args) -> bool:
    """Whether `args` select `spec`; ValueError for a selector value that misses the selecting one only by case or
    blanks (`Cake` for `cake`), which would otherwise leave the op silently unselected."""
    for dest, value in spec.selected_by:
        got = _get(args, dest)
        if got == value:
            return True
        if isinstance(got, str) and isinstance(value, str) and got.strip().casefold() == value.casefold():
            raise ValueError(f"--{_dash(dest)} {got!r} does not select cake op {spec.name!r}: selector values are "
                             f"case-sensitive; use {value!r}")
    return False


def _check_unselected(args, selected) -> None:
    """A variant or option given for an op that is not selected: ValueError (it would be ignored otherwise)."""
    names = {s.name for s in selected}
    for spec in registry.all_ops():
        if spec.name in names:
            continue
        given = [f"--cake-{_dash(spec.name)}-variant"] if _get(args, variant_dest(spec.name)) is not None else []
        given += [option_flag(spec.name, f.name) for f in spec.options
                  if _get(args, option_dest(spec.name, f.name)) not in (None, False)]
        if given:
            selector = " or ".join(f"--{_dash(d)} {v}" for d, v in spec.selected_by)
            raise ValueError(f"{', '.join(given)} given but cake op {spec.name!r} is not selected ({selector})")


def _check_keyword_names(fn: str, args) -> None:
    """`configure()`'s keyword names (`gqa_variant`) on parsed args are not read from there: refuse them rather than
    drop them (parsed args carry `cake_gqa_variant`, set by `--cake-gqa-variant`)."""
    have = getattr(args, "__dict__", None)
    if not isinstance(have, dict):
        return
    found = sorted(k for k in _keywords()[1:] if k in have and have[k] is not None)  # [0]: deterministic_mode
    if found:
        raise ValueError(f"{fn}(args): args has {', '.join(found)}, which is how configure() keywords are spelled; "
                         f"args are read through the flags' dests ({', '.join('cake_' + k for k in found)}, with the "
                         f"op selected), so these would be ignored. Call configure({found[0]}=...) instead, or set "
                         f"the dest")


def _keywords() -> list[str]:
    """Every keyword `configure()` accepts."""
    out = ["deterministic_mode", "workspace_pool_bytes"]
    for spec in registry.all_ops():
        out.append(f"{spec.name}_variant")
        out += [f"{spec.name}_{f.name}" for f in spec.options]
    return out


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, _keywords(), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------------------------------------------
# the miles hooks
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every op's flags to miles' parser (see module docstring). Returns the parser.

    Call it after miles has added its own flags (as miles' extension hook does): a flag miles already has
    (`--deterministic-mode`, a backend selector) is left alone; one it lacks is added here so the parser is complete.
    A flag the parser has under another `dest` is read from that dest (recorded as the parser default
    `cake_flag_dests`, so it travels on the parsed args).
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_arguments() takes an argparse.ArgumentParser, got {type(parser).__name__}")
    existing = dict(parser._option_string_actions)  # includes the flags of every argument group
    have = set(existing)
    dests = {a.dest for a in parser._actions}
    aliases = dict(parser.get_default(FLAG_DESTS) or {})
    group = parser.add_argument_group("miles_ext_kernels (cake ops)")

    def add(flag, dest, **kw):
        if flag in existing and existing[flag].dest != dest:
            aliases[dest] = existing[flag].dest  # the parser's flag, stored elsewhere: read it there
        if flag in have or dest in dests:
            return
        group.add_argument(flag, dest=dest, **kw)
        have.add(flag)
        dests.add(dest)

    add(DET_FLAG, "deterministic_mode", action="store_true", default=False,
        help="bitwise-reproducible training: every cake op runs its det variant")
    add(POOL_FLAG, "cake_workspace_pool_bytes", type=int, default=0,
        help="bound (bytes per device) of the workspace pool that keeps backward scratch between calls; "
             "0 keeps nothing")
    for spec in registry.all_ops():
        for dest, value in spec.selected_by:
            add(f"--{_dash(dest)}", dest, type=str, default=None,
                help=f"'{value}' selects the cake op {spec.name}")
        hidden = len(spec.cli_variants) == 1
        add(f"--cake-{_dash(spec.name)}-variant", variant_dest(spec.name), choices=spec.cli_variants, default=None,
            help=argparse.SUPPRESS if hidden else
            f"variant of cake op {spec.name}: {' | '.join(spec.cli_variants)} (default: fast; det under "
            f"--deterministic-mode)")
        for f in spec.options:
            kw = dict(action="store_true") if f.is_bool else dict(choices=f.choices)
            add(option_flag(spec.name, f.name), option_dest(spec.name, f.name), default=None,
                help=f"{f.help} (needs cake op {spec.name} selected)", **kw)
    if aliases:
        parser.set_defaults(**{FLAG_DESTS: aliases})
    return parser


def validate_args(args) -> None:
    """Resolve and check the cake flags of parsed `args` in place (see module docstring)."""
    _check_args("validate_args", args)
    _check_keyword_names("validate_args", args)
    deterministic = _deterministic_mode(args)
    pool = _get(args, "cake_workspace_pool_bytes")
    _set(args, "cake_workspace_pool_bytes", _check_pool_bytes(0 if pool is None else pool))
    selected = [spec for spec in registry.all_ops() if _is_selected(spec, args)]
    _check_unselected(args, selected)
    for spec in selected:
        _set(args, variant_dest(spec.name),
             _resolve_variant(spec, _get(args, variant_dest(spec.name)), deterministic, from_cli=True))
        for f in spec.options:
            dest = option_dest(spec.name, f.name)
            value = _get(args, dest)
            _set(args, dest, f.default if value is None else f.check_value(spec.name, value))
    for spec in selected:
        if spec.validate is not None:
            spec.validate(args)


_UNSET = object()


def configure(args=None, *, deterministic_mode=_UNSET, workspace_pool_bytes=_UNSET, **per_op) -> None:
    """Replace the whole configuration.

    configure(args)                      miles: after `validate_args(args)`, in every process.
    configure(gqa_variant="fast", ...)   direct callers: `<op>_variant` and `<op>_<option>` keywords.
    configure()                          back to defaults (det where an op has it, pool bound 0).
    """
    global _state
    if args is not None:
        _check_args("configure", args)
        _check_keyword_names("configure", args)
        if per_op or deterministic_mode is not _UNSET or workspace_pool_bytes is not _UNSET:
            raise TypeError("configure() takes either miles' args or keywords, not both")
        deterministic = _deterministic_mode(args)
        new = _State(deterministic, _check_pool_bytes(_get(args, "cake_workspace_pool_bytes", 0) or 0))
        selected = [spec for spec in registry.all_ops() if _is_selected(spec, args)]
        _check_unselected(args, selected)  # what validate_args would refuse is not dropped here either
        for spec in selected:
            new.variants[spec.name] = _resolve_variant(
                spec, _get(args, variant_dest(spec.name)), deterministic, from_cli=True)
            new.explicit.add(spec.name)
            for f in spec.options:
                value = _get(args, option_dest(spec.name, f.name))
                if value is not None:
                    new.options[(spec.name, f.name)] = f.check_value(spec.name, value)
    else:
        deterministic = False if deterministic_mode is _UNSET else deterministic_mode
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic_mode must be a bool, got {type(deterministic).__name__}")
        new = _State(deterministic, _check_pool_bytes(0 if workspace_pool_bytes is _UNSET else workspace_pool_bytes))
        specs = {s.name: s for s in registry.all_ops()}
        # longest op names first, so an op whose name prefixes another's (rmsnorm / gated_rmsnorm) is matched right
        names = sorted(specs, key=len, reverse=True)
        variants_given: dict[str, str] = {}
        for key, value in per_op.items():
            op = next((n for n in names if key.startswith(n + "_")), None)
            if op is None:
                raise TypeError(f"configure() got an unexpected keyword {key!r} (no cake op of that name)"
                                f"{_did_you_mean(key)}")
            name = key[len(op) + 1:]
            if name == "variant":
                variants_given[op] = value
                continue
            try:
                flag = specs[op].option(name)
            except KeyError:
                raise TypeError(f"configure() got an unexpected keyword {key!r}: op {op!r} takes {op}_variant and "
                                f"options {[f.name for f in specs[op].options]}{_did_you_mean(key)}") from None
            new.options[(op, name)] = flag.check_value(op, value)
        for op, given in variants_given.items():
            new.variants[op] = _resolve_variant(specs[op], given, deterministic, from_cli=False)
            new.explicit.add(op)
    old_bound = _state.pool_bytes
    _state = new
    _logged_downgrade.clear()
    if new.pool_bytes < old_bound:
        workspace = sys.modules.get("miles_ext_kernels.cake._runtime.workspace")
        if workspace is not None:
            workspace.shrink_to_bound()


def release() -> int:
    """Free every pooled workspace buffer and forget prebuild records; returns the bytes freed."""
    return registry.release()


# --------------------------------------------------------------------------------------------------------------
# read at call time by the implementations
def variant(op: str) -> str:
    """The variant a call of `op` runs now: "det" or "fast"."""
    v = _state.variants.get(op)
    if v is None:
        spec = registry.op_spec(op)
        if _state.deterministic_mode:
            if "det" not in spec.variants:
                raise RuntimeError(
                    f"cake op {op!r} has no det variant (it ships {spec.variants}) but the process is configured "
                    f"with deterministic_mode=True")
            v = "det"
        else:
            v = spec.default_variant
    if v == "fast":
        torch = sys.modules.get("torch")
        if torch is not None and torch.are_deterministic_algorithms_enabled():
            if "det" not in registry.op_spec(op).variants:
                raise RuntimeError(f"cake op {op!r} has no deterministic implementation, but "
                                   f"torch.use_deterministic_algorithms(True) is in effect")
            if op not in _logged_downgrade:
                _logged_downgrade.add(op)
                log.warning("cake op %s: fast variant configured but torch.use_deterministic_algorithms(True) is in "
                            "effect; running det", op)
            return "det"
    return v


def option(op: str, name: str) -> Any:
    """The value of option `name` of `op` now (its default when not configured)."""
    value = _state.options.get((op, name), _UNSET)
    if value is _UNSET:
        return registry.op_spec(op).option(name).default
    return value


def pool_bytes() -> int:
    """The workspace pool bound in bytes (per device); 0 keeps nothing."""
    return _state.pool_bytes


def deterministic_mode() -> bool:
    return _state.deterministic_mode


def configured() -> dict[str, str]:
    """Variant each op runs now, for `doctor`."""
    out = {}
    for spec in registry.all_ops():
        try:
            out[spec.name] = variant(spec.name)
        except RuntimeError as e:
            out[spec.name] = f"error: {e}"
    return out
