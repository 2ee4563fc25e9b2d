"""One autograd / custom-op surface per op, from one description (`KernelOp`).

From an op's forward and backward launchers (annotated Python functions: they become the schemas), `KernelOp`
registers the torch.library custom ops `miles_ext_kernels::<op>_fwd` and `<op>_bwd` with their fakes and the
forward's autograd, and one `torch.autograd.Function` for eager calls:
- eager: the Function calls the launchers directly (a custom-op dispatch costs ~70-100 us of host time per call,
  more than many of the kernels);
- under torch.compile: the forward custom op, whose autograd (`register_autograd`) calls the backward custom op;
  the trace records both as opaque nodes (their fakes give the shapes), so `torch.compile(fullgraph=True)` traces
  every op (an autograd.Function would refuse a tensor passed twice, as cu_seqlens_q and cu_seqlens_k often are);
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
        grad_inputs, non_differentiable = tuple(grad_inputs), tuple(non_differentiable)
        self.function = _make_function(self, setup, grad_inputs, n_outputs, non_differentiable)
        _register_autograd(self, setup, grad_inputs, n_outputs, non_differentiable)

    def __call__(self, *inputs):
        """The op's outputs (one tensor, or a tuple of `n_outputs`) for `inputs` (the forward's, without variant)."""
        variant = config.variant(self.op)
        if torch.compiler.is_compiling():
            res = self.forward_op(*inputs, variant)
        elif torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return self.function.apply(*inputs, variant)
        else:
            res = self.forward(*inputs, variant)
        return res[0] if self.n_outputs == 1 else res[:self.n_outputs]


def _register_autograd(kop: KernelOp, setup, grad_inputs, n_outputs, non_differentiable):
    """Autograd of the forward custom op (what torch.compile traces: dynamo takes an op with autograd registered
    whatever its inputs, e.g. one tensor passed twice, which an autograd.Function refuses). Its backward is the
    backward custom op, which has no autograd: a second derivative raises."""

    def setup_context(ctx, inputs, output):
        tensors, attrs = setup(inputs, output)
        ctx.save_for_backward(*tensors)
        ctx.attrs = attrs
        ctx.none_inputs = tuple(inputs[i] is None for i in grad_inputs)
        ctx.n_inputs = len(inputs)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(output[i] for i in range(len(output))
                                      if i >= n_outputs or i in non_differentiable))

    def backward(ctx, *grads):
        got = kop.backward_op(*grads[:n_outputs], *ctx.saved_tensors, *ctx.attrs)
        return _to_inputs(got, grad_inputs, ctx.none_inputs, ctx.n_inputs)

    kop.forward_op.register_autograd(backward, setup_context=setup_context)


def _to_inputs(got, grad_inputs, none_inputs, n_inputs) -> tuple:
    """The backward launcher's results placed at the inputs they are gradients of (None elsewhere)."""
    if isinstance(got, torch.Tensor):
        got = (got,)
    out = [None] * n_inputs
    for i, g, none in zip(grad_inputs, got, none_inputs):
        out[i] = None if none else g
    return tuple(out)


def _make_function(kop: KernelOp, setup, grad_inputs, n_outputs, non_differentiable):
    """The eager path's autograd.Function: the launchers called directly (no custom-op dispatch)."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            res = kop.forward(*inputs)
            tensors, attrs = setup(inputs, res)
            ctx.save_for_backward(*tensors)
            ctx.attrs, ctx.n_inputs = attrs, len(inputs)
            ctx.none_inputs = tuple(inputs[i] is None for i in grad_inputs)
            ctx.set_materialize_grads(False)
            outs = res[:n_outputs]
            if non_differentiable:
                ctx.mark_non_differentiable(*(outs[i] for i in non_differentiable))
            return outs[0] if n_outputs == 1 else outs

        @staticmethod
        @once_differentiable  # a second derivative raises instead of silently carrying no history
        def backward(ctx, *grads):
            got = kop.backward(*grads, *ctx.saved_tensors, *ctx.attrs)
            return _to_inputs(got, grad_inputs, ctx.none_inputs, ctx.n_inputs)

    Function.__name__ = Function.__qualname__ = f"{kop.op}_function"
    return Function
