"""Shared by the torch-free argument tests: miles' parser with our flags, parsed and validated."""
import argparse

import pytest

import miles_ext_kernels as mek


def parse_validated(*argv: str) -> argparse.Namespace:
    """`add_arguments` on a fresh parser, parse `argv`, then `validate_args` (which resolves and writes back)."""
    parser = argparse.ArgumentParser()
    mek.add_arguments(parser)
    args = parser.parse_args(list(argv))
    mek.validate_args(args)
    return args


def _variant_flag(op: str) -> str:
    return f"--cake-{op.replace('_', '-')}-variant"


def assert_cli_option(op: str, selector: tuple, option: str, default, flag: tuple, value) -> None:
    """Under its selector (`selector`: miles' flag and its value) `op` resolves to fast (miles' command-line default)
    with `option` at `default`; with `flag` (the option's flag and value, if any) and the det variant too,
    `configure(args)` makes the configuration det with `option` = `value`."""
    from miles_ext_kernels.cake._runtime import config

    args = parse_validated(*selector)
    assert getattr(args, f"cake_{op}_variant") == "fast"
    got = getattr(args, f"cake_{op}_{option}")
    assert got == default and type(got) is type(default), got
    args = parse_validated(*selector, *flag, _variant_flag(op), "det")
    mek.configure(args)
    assert config.variant(op) == "det"
    got = config.option(op, option)
    assert got == value and type(got) is type(value), got


def assert_cli_variants(op: str, selector: tuple) -> None:
    """Under its selector `op` resolves to fast (miles' command-line default), to det with --deterministic-mode or
    with its variant flag set to det; its variant flag without the selector, and fast with --deterministic-mode, are
    a ValueError."""
    variant = _variant_flag(op)
    assert getattr(parse_validated(*selector), f"cake_{op}_variant") == "fast"
    assert getattr(parse_validated(*selector, "--deterministic-mode"), f"cake_{op}_variant") == "det"
    assert getattr(parse_validated(*selector, variant, "det"), f"cake_{op}_variant") == "det"
    for v in ("det", "fast"):
        with pytest.raises(ValueError, match=op):
            parse_validated(variant, v)  # the variant without the selector
    with pytest.raises(ValueError, match="fast"):
        parse_validated(*selector, "--deterministic-mode", variant, "fast")
