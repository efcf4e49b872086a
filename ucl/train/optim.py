"""The optimizer around its tensors: hyperparameters as JSON, and creating state tensors so a
checkpoint can fill them."""
from __future__ import annotations


def hyperparameters(optimizer) -> list[dict]:
    """Each param group's settings (lr, betas, ...) as JSON values, without the parameters."""
    return [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _jsonable(v):
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
        return v.item()
    return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)


def restore_hyperparameters(optimizer, saved) -> None:
    groups = (saved or {}).get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        return  # another optimizer setup: keep the new job's hyperparameters
    for live, g in zip(optimizer.param_groups, groups):
        for k, v in g.items():
            if k in live and not isinstance(v, str):
                live[k] = tuple(v) if isinstance(live[k], tuple) else v


def init_state(optimizer) -> None:
    """Create the optimizer's state tensors (so they can be filled) with one step of zero gradients
    and a zero learning rate, leaving parameters unchanged."""
    import torch
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    grads = {}
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        for p in g["params"]:
            if p.requires_grad:
                grads[p] = p.grad
                p.grad = torch.zeros_like(p)
    try:  # our step pre-hook fences nothing here: load() waited for every snapshot first
        params = [p for g in optimizer.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        optimizer.step()
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)  # weight decay with lr 0 changes nothing, but be exact whatever the optimizer
    finally:
        for g, lr in saved:
            g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad
