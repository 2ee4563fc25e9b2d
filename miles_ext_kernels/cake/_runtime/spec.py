"""`OpSpec` and `Flag`: the whole declaration of an op, torch-free.

An op module (`cake/<op>.py`) builds one `OpSpec` named `OP`; the registry lists those modules. Everything the
command line, the configuration and prebuild need is read from the spec, so adding an op touches no runtime code.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

VARIANTS = ("det", "fast")

# The archs ops may serve, by CUDA compute capability (each op lists the ones it serves in OpSpec.archs).
ARCH_BY_CAPABILITY: dict[tuple[int, int], str] = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}


@dataclass(frozen=True)
class Flag:
    """One option of an op.

    `choices=None` makes a boolean flag (`store_true`, default False); otherwise a string choice with `default`
    (the first choice when not given). On miles' command line it is `--cake-<op>-<name>` (underscores become
    dashes), stored on `args` as `cake_<op>_<name>`; direct callers pass `configure(<op>_<name>=...)`.
    """

    name: str
    help: str
    choices: tuple[str, ...] | None = None
    default: Any = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"Flag name must be an identifier, got {self.name!r}")
        if self.choices is None:
            if self.default not in (None, False):
                raise ValueError(f"boolean Flag {self.name!r} defaults to False")
            object.__setattr__(self, "default", False)
        else:
            object.__setattr__(self, "choices", tuple(self.choices))
            if self.default is None:
                object.__setattr__(self, "default", self.choices[0])
            if self.default not in self.choices:
                raise ValueError(f"Flag {self.name!r}: default {self.default!r} not in {self.choices}")

    @property
    def is_bool(self) -> bool:
        return self.choices is None

    def check_value(self, op: str, value: Any) -> Any:
        """Validate a configured value; raises ValueError/TypeError naming `<op>_<name>`."""
        key = f"{op}_{self.name}"
        if self.is_bool:
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be a bool, got {type(value).__name__}")
        elif value not in self.choices:
            raise ValueError(f"{key} must be one of {self.choices}, got {value!r}")
        return value


@dataclass(frozen=True)
class OpSpec:
    """Declaration of one op.

    name:            op name (`gqa`, `rmsnorm`, ...); its implementation package is `cake._impl.<name>` unless
                     `impl_path` names another importable module (synthetic ops in tests).
    variants:        what the op ships, a subset of ("det", "fast").
    cli_variants:    what miles' command line may choose (default: `variants`); one choice hides the flag.
    selected_by:     ((args attribute, value), ...): the miles flag(s) that select the op.
    entry_points:    public functions the implementation package exports.
    options:         op flags (`Flag`), each requiring the op's selector on the command line.
    validate:        callable(args) run by `validate_args` when the op is selected (startup checks).
    prebuild_params: model parameters `cake.prebuild(op, **params)` requires (exactly these).
    archs:           GPU architectures the op's kernels serve (see ARCH_BY_CAPABILITY).
    impl_path:       implementation module (default `miles_ext_kernels.cake._impl.<name>`).
    bench:           stem of its benchmark script `bench/<bench>.py` (default: the op name).
    """

    name: str
    variants: tuple[str, ...] = VARIANTS
    cli_variants: tuple[str, ...] | None = None
    selected_by: tuple[tuple[str, str], ...] = ()
    entry_points: tuple[str, ...] = ()
    options: tuple[Flag, ...] = ()
    validate: Callable[[Any], None] | None = None
    prebuild_params: tuple[str, ...] = ()
    archs: tuple[str, ...] = ("sm_90a",)
    impl_path: str | None = None
    bench: str | None = None
    _impl_cache: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"op name must be an identifier, got {self.name!r}")
        object.__setattr__(self, "variants", tuple(self.variants))
        if not self.variants or any(v not in VARIANTS for v in self.variants):
            raise ValueError(f"op {self.name!r}: variants must be a non-empty subset of {VARIANTS}")
        cli = tuple(self.cli_variants) if self.cli_variants is not None else self.variants
        if not cli or any(v not in self.variants for v in cli):
            raise ValueError(f"op {self.name!r}: cli_variants {cli} must be a non-empty subset of {self.variants}")
        object.__setattr__(self, "cli_variants", cli)
        object.__setattr__(self, "selected_by", tuple(tuple(s) for s in self.selected_by))
        object.__setattr__(self, "options", tuple(self.options))
        names = [f.name for f in self.options]
        if len(set(names)) != len(names) or "variant" in names:
            raise ValueError(f"op {self.name!r}: option names must be unique and not 'variant'")

    @property
    def default_variant(self) -> str:
        """What a process that never configured the op runs: det where the op has it."""
        return "det" if "det" in self.variants else self.variants[0]

    def option(self, name: str) -> Flag:
        for f in self.options:
            if f.name == name:
                return f
        raise KeyError(f"op {self.name!r} has no option {name!r}")

    def impl(self):
        """The implementation module, imported on first use (this is where torch and triton get imported)."""
        if self._impl_cache:
            return self._impl_cache[0]
        module = importlib.import_module(self.impl_path or f"miles_ext_kernels.cake._impl.{self.name}")
        self._impl_cache.append(module)
        return module

    def is_selected(self, args) -> bool:
        """Whether miles' parsed `args` select this op."""
        return any(getattr(args, dest, None) == value for dest, value in self.selected_by)
