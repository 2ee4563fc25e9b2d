"""The CP cases that distributed ranks (one process each: gloo on CPU, NCCL on GPUs) and simulated ranks (one
process) both run: the same inputs and kernels, so the same bits."""
import importlib

import torch

from miles_ext_kernels.cake._runtime import cp as rcp

NAMES = ("q", "k", "v", "g", "beta")
TINY = {"H": 1, "HV": 2, "K": 16, "V": 16, "D": 24, "Wc": 4}  # the gloo (interpreter) sizes


def _mod(op, name):
    return importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.{name}")


def inputs(op: str, lens: list, dims: dict = TINY, device="cpu") -> dict:
    """One case's whole-stream inputs (made on the host, so every process draws the same), moved to `device`."""
    if op == "gdn":
        inp = _mod("gdn", "demo").make_inputs(lens, dims["H"], dims["HV"], dims["K"], dims["V"], "cpu", h0=False)
    elif op == "kda":
        inp = _mod("kda", "demo").make_inputs(lens, dims["H"], dims["HV"], dims["K"], dims["V"], "cpu", h0=False,
                                               gate="safe")
    elif op == "conv1d":
        g = torch.Generator().manual_seed(0)
        T, D, Wc = sum(lens), dims["D"], dims["Wc"]
        inp = {"x": torch.randn(T, D, generator=g).to(torch.bfloat16),
               "w": (torch.randn(D, Wc, generator=g) * 0.5).float(),
               "dy": torch.randn(T, D, generator=g).to(torch.bfloat16),
               "cu": torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)}
    else:
        raise ValueError(op)
    return {n: t.to(device) if torch.is_tensor(t) else t for n, t in inp.items()}


def context(op: str, inp: dict, group, layout: str):
    from miles_ext_kernels import cake

    kw = {"conv1d_kernel_size": inp["w"].shape[1]} if op == "conv1d" else {}
    return cake.build_cp_context(inp["cu"], group, layout=layout, **kw)


def run_rank(op: str, inp: dict, ctx) -> dict:
    """One rank through the public entry point and autograd: its outputs and gradients (parameters: its partials)."""
    from miles_ext_kernels import cake

    if op == "conv1d":
        xs = rcp.shard(inp["x"], ctx, 0).clone().requires_grad_(True)
        w = inp["w"].clone().requires_grad_(True)
        y = cake.causal_conv1d(xs, w, cp_context=ctx)
        y.backward(rcp.shard(inp["dy"], ctx, 0))
        return {"y": y.detach(), "dx": xs.grad, "dw": w.grad}
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
    """Every rank in one process (`_runtime.cp.simulate`), on the inputs' device: whole-stream outputs and
    gradients (parameters: the ranks' partials summed in rank order)."""
    device = inp["cu"].device
    ops = _mod(op, "ops")
    if op == "conv1d":
        ctxs = rcp.simulated_contexts(inp["cu"], world, layout=layout, conv1d_kernel_size=inp["w"].shape[1],
                                      device=device)
        y, (dx, dw) = rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, [inp["x"]], params=[inp["w"]],
                                   args=(ops._act_mode("silu"),), grad_out=inp["dy"], token_dim=0)
        return {"y": y, "dx": dx, "dw": dw}
    ctxs = rcp.simulated_contexts(inp["cu"], world, layout=layout, device=device)
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


def rmsnorm_inputs(T: int, H: int, device="cpu") -> dict:
    g = torch.Generator().manual_seed(3)
    x = {"x": torch.randn(T, H, generator=g).to(torch.bfloat16), "w": torch.randn(H, generator=g) * 0.1,
         "dy": torch.randn(T, H, generator=g).to(torch.bfloat16)}
    return {n: t.to(device) for n, t in x.items()}


def rmsnorm_sp_rank(lens: list, dims: dict, device, group) -> dict:
    """rmsnorm under sequence parallelism (Megatron's rule): this rank's contiguous token slice of the stream, its
    weight-gradient partial all-reduced (sum) over the group. Returns y, dx of the slice, the reduced dw."""
    import torch.distributed as dist

    from miles_ext_kernels import cake

    inp = rmsnorm_inputs(sum(lens), dims["D"], device)
    W, r = dist.get_world_size(group), dist.get_rank(group)
    n = inp["x"].shape[0] // W
    x = inp["x"][r * n:(r + 1) * n].clone().requires_grad_(True)
    w = inp["w"].clone().requires_grad_(True)
    y = cake.zero_centered_rmsnorm(x, w)
    y.backward(inp["dy"][r * n:(r + 1) * n])
    dw = w.grad.clone()
    dist.all_reduce(dw, group=group)
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": dw.cpu()}


PARTIALS = ("dA_log", "ddt_bias", "dw")  # parameter gradients: each rank's partial sum


def gathered(op: str, inp: dict, layout: str, world: int, ranks: list) -> dict:
    """The ranks' results as whole-stream tensors: token tensors unsharded, parameter partials summed in rank
    order (as `simulate` sums them)."""
    kw = {"conv1d_kernel_size": inp["w"].shape[1]} if op == "conv1d" else {}
    ctxs = rcp.simulated_contexts(inp["cu"].cpu(), world, layout=layout, **kw)
    out = {}
    for name in ranks[0]:
        if name in PARTIALS:
            got = ranks[0][name].clone()
            for r in ranks[1:]:
                got += r[name]
        else:
            got = rcp.unshard([r[name] for r in ranks], ctxs, 0 if op == "conv1d" else 1)
        out[name] = got
    return out


def spawn_ranks(op: str, layout: str, world: int, lens: list, out_dir, backend: str = "gloo",
                dims: dict = TINY) -> list:
    """Run `world` rank processes of tests/cake/cp/_gloo_rank.py (a free local port, NCCL's multicast off) and
    return their saved results in rank order; a rank that fails fails the caller with its output's tail."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from tests._paths import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   CP_BACKEND=backend, NCCL_NVLS_ENABLE="0",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if backend == "gloo":
            env["TRITON_INTERPRET"] = "1"
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.cake.cp._gloo_rank", op, layout, json.dumps(lens),
                                       str(out_dir), json.dumps(dims)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
