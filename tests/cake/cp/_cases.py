"""The CP cases that gloo ranks (one process each) and simulated ranks (one process) both run: the same inputs and
kernels, so the same bits."""
import importlib

from miles_ext_kernels.cake._runtime import cp as rcp

NAMES = ("q", "k", "v", "g", "beta")


def _mod(op, name):
    return importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.{name}")


def inputs(op: str, lens: list) -> dict:
    if op == "gdn":
        return _mod("gdn", "demo").make_inputs(lens, 1, 2, 16, 16, "cpu", h0=False)
    if op == "kda":
        return _mod("kda", "demo").make_inputs(lens, 1, 2, 16, 16, "cpu", h0=False, gate="safe")
    raise ValueError(op)


def run_rank(op: str, inp: dict, ctx) -> dict:
    """One rank through the public entry point and autograd: its outputs and gradients (parameters: its partials)."""
    from miles_ext_kernels import cake

    x = {n: rcp.shard(inp[n], ctx).clone().requires_grad_(True) for n in NAMES}
    if op == "gdn":
        o, _ = cake.chunk_gated_delta_rule(*x.values(), use_qk_l2norm_in_kernel=True, cp_context=ctx)
    else:
        x["A_log"] = inp["A_log"].clone().requires_grad_(True)
        x["dt_bias"] = inp["dt_bias"].clone().requires_grad_(True)
        o, _ = cake.chunk_kda(*[x[n] for n in NAMES], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              A_log=x["A_log"], dt_bias=x["dt_bias"], safe_gate=True,
                              lower_bound=inp["lower_bound"], cp_context=ctx)
    o.backward(rcp.shard(inp["do"], ctx))
    return {"o": o.detach()} | {"d" + n: t.grad for n, t in x.items()}


def run_simulated(op: str, inp: dict, layout: str, world: int) -> dict:
    """Every rank in one process (`_runtime.cp.simulate`): whole-stream outputs and gradients."""
    ctxs = rcp.simulated_contexts(inp["cu"], world, layout=layout)
    ops = _mod(op, "ops")
    K = inp["q"].shape[-1]
    if op == "gdn":
        params, args = [], (K ** -0.5, True, True)
    else:
        gate = ops.gate_kind(True, inp["lower_bound"])
        params, args = [inp["A_log"], inp["dt_bias"]], (K ** -0.5, float(inp["lower_bound"]), gate, True)
    o, grads = rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, [inp[n] for n in NAMES],
                            params=params, args=args, grad_out=inp["do"])
    names = NAMES + (("A_log", "dt_bias") if op == "kda" else ())
    return {"o": o} | {"d" + n: g for n, g in zip(names, grads)}
