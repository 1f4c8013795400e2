"""Optimizers as `(init, update)` pairs of pure functions over pytrees.

`init(params) -> opt_state` builds the state, a NamedTuple of the steps taken (`count`) and
moment trees like the params (`AdamState`, `MomentumState`); `update(params, grads, opt_state,
lr, grad_scale=1.0) -> (params, opt_state)` applies one step with the gradients times
`grad_scale` (the step's averaging and clipping factor: the fused AdamW kernel applies it as it
reads each gradient, which saves a pass over all of them). Parameters and moments are donated:
they are updated in place (one `torch._foreach_*` kernel per operation over all tensors, not a
Python loop of small kernels) and returned; the caller must not keep using the old ones. With a
`grad_scale` other than 1 the gradients are donated as well (they may be scaled in place).

Weight decay is decoupled (AdamW style) for every optimizer: `p <- p * (1 - lr * wd)` on the
tensors the decay mask selects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

Tree = Any
FUSED_DEVICES = ("cpu", "cuda")  # where torch._fused_adamw_ has kernels


class AdamState(NamedTuple):
    """AdamW's state: steps taken, first and second moments (trees like the params)."""

    count: int
    m: Tree
    v: Tree


class MomentumState(NamedTuple):
    """SGD's and Lion's state: steps taken and one momentum tree like the params."""

    count: int
    m: Tree


OptState = AdamState | MomentumState


class Optimizer(NamedTuple):
    init: Callable[[Tree], OptState]
    update: Callable[..., tuple[Tree, OptState]]  # (params, grads, state, lr, grad_scale=1.0)


def moments(state: OptState) -> dict[str, Tree]:
    """The state's moment trees by field name; `count` is its one number."""
    return {k: v for k, v in state._asdict().items() if k != "count"}


def decay_mask(
    params: Tree,
    decay_norms: bool = False,
    decay_biases: bool = False,
    decay_embeddings: bool = False,
) -> Tree:
    """A tree of bools like `params`: True where weight decay applies.

    Norm gains, biases and embeddings are left alone by default: shrinking a gain towards zero or
    a rarely seen token's embedding towards zero is not regularisation, it is damage.
    """

    def wants_decay(path: str, t: torch.Tensor) -> bool:
        if "embed_tokens" in path:
            return decay_embeddings
        if path.endswith(".bias"):
            return decay_biases
        if "norm" in path.rsplit(".", 2)[-2] or t.dim() < 2:
            return decay_norms
        return True

    if isinstance(params, dict) and all(isinstance(v, torch.Tensor) for v in params.values()):
        return {k: wants_decay(k, v) for k, v in params.items()}
    # Nested trees (the LoRA "weights"): every low-rank factor is a matrix and is decayed.
    return tree_map(lambda t: t.dim() >= 2 or decay_norms, params)


def leaves_like(tree: Tree, like: Tree) -> list:
    """The leaves of `tree` in the order of `like`'s keys: moments read back from a checkpoint
    may list their keys in another order than the params, and leaves are paired by position."""
    if isinstance(like, dict):
        return [leaf for k in like for leaf in leaves_like(tree[k], like[k])]
    return [tree]


def _split(leaves: list, mask: list[bool]) -> list:
    return [x for x, m in zip(leaves, mask) if m]


def _decay(params: list, mask: list[bool], lr: float, weight_decay: float) -> None:
    decayed = _split(params, mask)
    if weight_decay and decayed:
        torch._foreach_mul_(decayed, 1.0 - lr * weight_decay)


def _mask_leaves(params: Tree, mask: Tree | None) -> list[bool]:
    if mask is None:
        return [True] * len(tree_flatten(params)[0])
    return leaves_like(mask, params)


def adamw(
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Tree | None = None,
    fused: bool = False,
) -> Optimizer:
    """AdamW exactly as `torch.optim.AdamW` computes it (same order of operations).

    fused=True uses torch's fused kernel where the device has one: one pass over memory instead
    of about eight, where on CPUs each foreach op is a loop over the tensors. It agrees with
    the foreach path to rounding, not bit for bit. The kernel is a private torch op
    (`torch._fused_adamw_`), which may change or vanish between releases: where it is missing
    the foreach path runs instead (`fused_adamw_available`).
    """

    def init(params: Tree) -> AdamState:
        return AdamState(0, tree_map(torch.zeros_like, params), tree_map(torch.zeros_like, params))

    def update(
        params: Tree, grads: Tree, state: AdamState, lr: float, grad_scale: float = 1.0
    ) -> tuple[Tree, AdamState]:
        p = tree_flatten(params)[0]
        g, m, v = (leaves_like(t, params) for t in (grads, state.m, state.v))
        count = state.count + 1
        decays = _mask_leaves(params, mask)
        if fused and p and fused_adamw_available(p[0].device):
            _fused_adamw(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay, grad_scale)
        else:
            _scale(g, grad_scale)
            _adamw(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay)
        return params, state._replace(count=count)

    return Optimizer(init, update)


def fused_adamw_available(device: torch.device) -> bool:
    """Whether this torch has the private fused AdamW op and a kernel of it for `device`."""
    return device.type in FUSED_DEVICES and callable(getattr(torch, "_fused_adamw_", None))


def _adamw(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay) -> None:
    """AdamW in public `torch._foreach_*` ops, in torch.optim.AdamW's order of operations."""
    _decay(p, decays, lr, weight_decay)
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, 1.0 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, (1.0 - beta2**count) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p, m, denom, -lr / (1.0 - beta1**count))


def _scale(grads: list, grad_scale: float) -> None:
    if grad_scale != 1.0:
        torch._foreach_mul_(grads, grad_scale)


def _fused_adamw(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay, grad_scale):
    # The kernel divides each gradient by its grad_scale tensor (it is made for unscaling AMP
    # gradients) as it reads it, in the same pass as the moments and the update.
    divisor = None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, device=p[0].device)
    for wd, keep in ((weight_decay, True), (0.0, False)):
        group = [i for i, d in enumerate(decays) if d == keep]
        if not group:
            continue
        steps = [torch.tensor(float(count), device=p[i].device) for i in group]
        torch._fused_adamw_(
            [p[i] for i in group],
            [g[i] for i in group],
            [m[i] for i in group],
            [v[i] for i in group],
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=divisor,
        )


def sgd(
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Tree | None = None,
) -> Optimizer:
    """SGD with heavy-ball (or Nesterov) momentum: buf <- momentum * buf + g; p <- p - lr * buf."""

    def update(params: Tree, grads: Tree, state: MomentumState, lr: float, grad_scale=1.0):
        p, g, buf = _decayed_leaves(params, grads, state, mask, lr, weight_decay)
        _scale(g, grad_scale)
        if momentum:
            torch._foreach_mul_(buf, momentum)
            torch._foreach_add_(buf, g)
            step = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        else:
            step = g
        torch._foreach_add_(p, step, alpha=-lr)
        return params, state._replace(count=state.count + 1)

    return Optimizer(_init_momentum, update)


def lion(
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    mask: Tree | None = None,
) -> Optimizer:
    """Lion (Chen et al. 2023): step by the sign of an interpolated momentum.

    Its steps have unit size per coordinate, so it wants a learning rate 3-10x below AdamW's.
    """

    def update(params: Tree, grads: Tree, state: MomentumState, lr: float, grad_scale=1.0):
        p, g, m = _decayed_leaves(params, grads, state, mask, lr, weight_decay)
        _scale(g, grad_scale)
        direction = torch._foreach_lerp(m, g, 1.0 - beta1)
        torch._foreach_sign_(direction)
        torch._foreach_add_(p, direction, alpha=-lr)
        torch._foreach_lerp_(m, g, 1.0 - beta2)
        return params, state._replace(count=state.count + 1)

    return Optimizer(_init_momentum, update)


def _init_momentum(params: Tree) -> MomentumState:
    return MomentumState(0, tree_map(torch.zeros_like, params))


def _decayed_leaves(params: Tree, grads: Tree, state: MomentumState, mask, lr: float, wd: float):
    """The leaves of params, grads and the moment buffer, paired by position, after applying
    the decoupled weight decay to the params."""
    p = tree_flatten(params)[0]
    g, m = leaves_like(grads, params), leaves_like(state.m, params)
    _decay(p, _mask_leaves(params, mask), lr, wd)
    return p, g, m


def make_optimizer(opt_cfg, trainable: Tree) -> Optimizer:
    """The optimizer an `OptimizerConfig` names, with its weight-decay mask over `trainable`."""
    mask = decay_mask(
        trainable, opt_cfg.decay_norms, opt_cfg.decay_biases, opt_cfg.decay_embeddings
    )
    builders = {
        "adamw": lambda: adamw(
            opt_cfg.beta1, opt_cfg.beta2, opt_cfg.eps, opt_cfg.weight_decay, mask, opt_cfg.fused
        ),
        "sgd": lambda: sgd(opt_cfg.momentum, opt_cfg.nesterov, opt_cfg.weight_decay, mask),
        "lion": lambda: lion(opt_cfg.beta1, opt_cfg.beta2, opt_cfg.weight_decay, mask),
    }
    return builders[opt_cfg.name]()
