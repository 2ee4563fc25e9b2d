"""Kernel helpers shared by several ops (candidates for the runtime)."""
