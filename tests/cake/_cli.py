"""Shared by the torch-free argument tests: miles' parser with our flags, parsed and validated."""
import argparse

import miles_ext_kernels as mek


def parse_validated(*argv: str) -> argparse.Namespace:
    """`add_arguments` on a fresh parser, parse `argv`, then `validate_args` (which resolves and writes back)."""
    parser = argparse.ArgumentParser()
    mek.add_arguments(parser)
    args = parser.parse_args(list(argv))
    mek.validate_args(args)
    return args
