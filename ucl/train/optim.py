"""The optimizer around its tensors: hyperparameters as JSON, and creating or dropping state
tensors so that the live optimizer holds state for exactly the parameters a checkpoint has it for."""
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
    """Put the saved settings back. A setting the live group holds as a tensor (``lr=torch.tensor(...)``
    for a compiled or capturable optimizer) is filled in place: it stays that tensor."""
    groups = (saved or {}).get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        return  # another optimizer setup: keep the new job's hyperparameters
    for live, g in zip(optimizer.param_groups, groups):
        for k, v in g.items():
            if k in live and not isinstance(v, str):
                live[k] = _restored(live[k], v)


def _restored(live, value):
    import torch
    if torch.is_tensor(live) and isinstance(value, (bool, int, float)):
        with torch.no_grad():
            live.fill_(value)
        return live
    if isinstance(live, (tuple, list)) and isinstance(value, list) and len(live) == len(value):
        return type(live)(_restored(a, b) for a, b in zip(live, value))
    return value


def match_state(optimizer, params: dict, wanted: set[str]) -> None:
    """Make ``optimizer`` hold state for exactly the parameters named in ``wanted`` (``params``:
    name -> parameter), as ``Optimizer.load_state_dict`` replaces the whole state: state is created
    for the wanted ones without it (a parameter still frozen, one no gradient reached yet) and
    dropped for the others (a rollback to before they had any)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in params.items():
        if name not in wanted and optimizer.state.get(p):
            del optimizer.state[p]
    init_state(optimizer, [p for n, p in params.items()
                           if n in wanted and id(p) in held and not optimizer.state.get(p)])


def init_state(optimizer, params: list) -> None:
    """Create the optimizer's state tensors for ``params`` (so they can be filled) with one step of
    zero gradients at a zero learning rate, leaving other parameters' state unchanged. The caller
    loads every parameter right after: no copy of them is kept to put back (on a GPU that copy
    could be what runs out of memory), although at learning rate 0 they do not change anyway."""
    import torch
    if not params:
        return
    chosen = {id(p) for p in params}
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    saved_lr = [(g, g["lr"]) for g in optimizer.param_groups]
    saved_grads = [(p, p.grad) for p in everything]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        for p in everything:  # only the chosen ones take part: the others have no gradient
            zero = torch.zeros_like(p) if id(p) in chosen else None
            p.grad = zero.to_sparse() if zero is not None and sparse else zero
        # the class's own step, without the step hooks: our fence has nothing to wait for (load()
        # waited), and a user's post-hook (an EMA update, a step counter) must not see this step
        step = getattr(type(optimizer).step, "__wrapped__", None)
        step(optimizer) if step is not None else optimizer.step()
    finally:
        for g, lr in saved_lr:
            g["lr"] = lr
        for p, grad in saved_grads:
            p.grad = grad
