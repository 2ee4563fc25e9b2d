"""One autograd / custom-op surface per op, from one description (`KernelOp`).

From an op's forward and backward launchers (annotated Python functions: they become the schemas), `KernelOp`
registers the torch.library custom ops `miles_ext_kernels::<op>_fwd` and `<op>_bwd` with their fakes, and one
`torch.autograd.Function` that every call goes through:
- eager: the Function calls the launchers directly (a custom-op dispatch costs ~70-100 us of host time per call,
  more than many of the kernels);
- under torch.compile: the same Function calls the custom ops, which the trace records as opaque nodes (their
  fakes give the shapes), so `torch.compile(fullgraph=True)` traces every op;
- no input needs a gradient (inference, or grad mode off): the forward launcher alone, no autograd node.
The variant configured when the call runs (`config.variant(op)`) is the forward's last argument, named `variant`,
in every op; the backward receives what its forward ran (`setup` saves it).

Description:
- forward(*inputs, variant) -> tuple of tensors: the first `n_outputs` are the op's outputs, the rest are kept for
  the backward only (`setup` picks what to save).
- setup(inputs, results) -> (tensors, attrs): the tensors to save (None allowed) and host values for the backward.
- backward(*output_grads, *saved tensors, *attrs) -> tuple of tensors, one per entry of `grad_inputs` (the indices
  of the inputs they are gradients of); an input that was None gets None whatever the launcher returned (custom
  ops cannot return None: launchers return an empty tensor there). Output gradients arrive as None when autograd
  has none for that output (they are not materialised as zeros).
- non_differentiable: indices of outputs autograd must not differentiate (e.g. an LSE).
Launchers run with the first tensor input's GPU current (`build.device_guard`).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from . import build, config

NAMESPACE = "miles_ext_kernels"


def _guarded(fn: Callable) -> Callable:
    """`fn` run with the GPU of its first tensor argument current (the signature stays `fn`'s, for the schema)."""

    @functools.wraps(fn)
    def run(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                with build.device_guard(a):
                    return fn(*args)
        return fn(*args)
    # the schema is inferred from the signature: its annotations evaluated where `fn` was written
    run.__signature__ = inspect.signature(fn, eval_str=True)
    return run


class KernelOp:
    """See the module docstring."""

    def __init__(self, op: str, *, forward: Callable, forward_fake: Callable, setup: Callable, backward: Callable,
                 backward_fake: Callable, grad_inputs: tuple, n_outputs: int = 1, non_differentiable: tuple = ()):
        self.op = op
        self.forward = _guarded(forward)
        self.backward = _guarded(backward)
        self.forward_op = torch.library.custom_op(f"{NAMESPACE}::{op}_fwd", self.forward, mutates_args=())
        self.forward_op.register_fake(forward_fake)
        self.backward_op = torch.library.custom_op(f"{NAMESPACE}::{op}_bwd", self.backward, mutates_args=())
        self.backward_op.register_fake(backward_fake)
        self.n_outputs = n_outputs
        self.function = _make_function(self, setup, tuple(grad_inputs), n_outputs, tuple(non_differentiable))

    def __call__(self, *inputs):
        """The op's outputs (one tensor, or a tuple of `n_outputs`) for `inputs` (the forward's, without variant)."""
        variant = config.variant(self.op)
        if torch.compiler.is_compiling():
            return self.function.apply(True, *inputs, variant)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return self.function.apply(False, *inputs, variant)
        res = self.forward(*inputs, variant)
        return res[0] if self.n_outputs == 1 else res[:self.n_outputs]


def _make_function(kop: KernelOp, setup, grad_inputs, n_outputs, non_differentiable):
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, compiled, *inputs):
            res = (kop.forward_op if compiled else kop.forward)(*inputs)
            tensors, attrs = setup(inputs, res)
            ctx.save_for_backward(*tensors)
            ctx.attrs, ctx.compiled, ctx.n_inputs = attrs, compiled, len(inputs)
            ctx.none_inputs = tuple(inputs[i] is None for i in grad_inputs)
            ctx.set_materialize_grads(False)
            outs = res[:n_outputs]
            if non_differentiable:
                ctx.mark_non_differentiable(*(outs[i] for i in non_differentiable))
            return outs[0] if n_outputs == 1 else outs

        @staticmethod
        @once_differentiable  # a second derivative raises instead of silently carrying no history
        def backward(ctx, *grads):
            fn = kop.backward_op if ctx.compiled else kop.backward
            got = fn(*grads, *ctx.saved_tensors, *ctx.attrs)
            if isinstance(got, torch.Tensor):
                got = (got,)
            out = [None] * (1 + ctx.n_inputs)
            for i, g, none in zip(grad_inputs, got, ctx.none_inputs):
                out[1 + i] = None if none else g
            return tuple(out)

    Function.__name__ = Function.__qualname__ = f"{kop.op}_function"
    return Function
