"""What gdn's and kda's demo.py share: the first draws of a case's inputs, the backward of one run, the demo rows."""
from __future__ import annotations

import torch


def draw_qkv(lens, H: int, HV: int, K: int, V: int, *, seed: int, l2: bool) -> tuple:
    """(r, gen, q, k, v) of a case of documents `lens`: q, k `[1, T, H, K]` and v `[1, T, HV, V]` bf16 drawn from
    `gen` (seeded by `seed`) in that order, q and k L2-normalised already unless `l2` (the kernel's norm); r(*shape)
    draws the next normal tensor from `gen`."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*s):
        return torch.randn(*s, generator=gen)

    q = r(1, T, H, K).to(torch.bfloat16)
    k = r(1, T, H, K).to(torch.bfloat16)
    if not l2:
        q = torch.nn.functional.normalize(q.float(), dim=-1).to(torch.bfloat16)
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    return r, gen, q, k, v


def cu_of(lens) -> torch.Tensor:
    """int32 cu_seqlens of documents `lens` (on the host)."""
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def to_device(tensors: dict, device) -> dict:
    """`tensors` on `device` (None stays None)."""
    return {n: (x.to(device) if x is not None else None) for n, x in tensors.items()}


def backward(o, ht, leaves: dict, do, dht, *, final: bool = True, dtype=torch.float32) -> dict:
    """Backpropagate sum(o do) (+ sum(ht dht) with `final`), products in `dtype` (do and dht brought to o's device
    and that dtype; ht's own dtype for its product); returns {"o", "ht" (with `final`), "d<leaf>" for each leaf}."""
    loss = (o.to(dtype) * do.to(o.device, dtype)).sum()
    (loss + (ht * dht.to(ht.device, ht.dtype)).sum() if final else loss).backward()
    grads = {"d" + n: t.grad for n, t in leaves.items()}
    return {"o": o.detach(), **({"ht": ht.detach()} if final else {}), **grads}


def demo_rows(op: str, budgets: dict, runs, error) -> list[dict]:
    """demo()'s rows: for each (case, ours, reference) of `runs`, one row per tensor of ours with its error
    (`error(name, got, reference)`) and budget (`budgets[name]`)."""
    rows = []
    for case, ours, ref in runs:
        for name, got in ours.items():
            err = error(name, got, ref)
            budget = budgets[name]
            rows.append(dict(op=op, case=case, tensor=name, err=err, budget=budget, ok=err <= budget))
    return rows
