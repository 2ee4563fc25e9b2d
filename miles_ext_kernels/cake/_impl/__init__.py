"""Implementations of the cake ops: one package per op (`_impl/<op>/`), loaded on the op's first call."""
