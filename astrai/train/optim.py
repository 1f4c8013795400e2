"""Optimizers as `(init, update)` pairs of pure functions over pytrees.

`init(params) -> opt_state` builds the state, a NamedTuple of the steps taken (`count`) and
moment trees like the params (`AdamState`, `MomentumState`, `MuonState`); `update(params, grads,
opt_state, lr, grad_scale=1.0) -> (params, opt_state)` applies one step with the gradients times
`grad_scale` (the step's averaging and clipping factor: the fused AdamW kernel applies it as it
reads each gradient, which saves a pass over all of them). Parameters and moments are donated:
they are updated in place (one `torch._foreach_*` kernel per operation over all tensors, not a
Python loop of small kernels) and returned; the caller must not keep using the old ones. With a
`grad_scale` other than 1 the gradients are donated as well (they may be scaled in place).

Weight decay is decoupled (AdamW style) for every optimizer: `p <- p * (1 - lr * wd)` on the
tensors the decay mask selects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from astrai.hardware import native_bf16

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


class MuonState(NamedTuple):
    """Muon's state: steps taken, a first moment for every tensor (Muon's momentum on the hidden
    matrices, AdamW's first moment on the rest) and AdamW's second moment, empty (0 elements)
    for the matrices Muon updates, which keep none."""

    count: int
    m: Tree
    v: Tree


OptState = AdamState | MomentumState | MuonState


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

    # Nested trees (the LoRA "weights"): every low-rank factor is a matrix and is decayed.
    return _path_mask(params, wants_decay, lambda t: t.dim() >= 2 or decay_norms)


def _path_mask(params: Tree, by_path: Callable, nested: Callable) -> Tree:
    """A tree of bools like `params`: by_path(name, tensor) over a flat dict of named tensors
    (a model's params), nested(tensor) over any other tree, whose leaves have no paths."""
    if isinstance(params, dict) and all(isinstance(v, torch.Tensor) for v in params.values()):
        return {k: by_path(k, v) for k, v in params.items()}
    return tree_map(nested, params)


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
        hyper = (lr, beta1, beta2, eps, weight_decay, grad_scale, fused)
        _adam_leaves(p, g, m, v, _mask_leaves(params, mask), count, *hyper)
        return params, state._replace(count=count)

    return Optimizer(init, update)


def _adam_leaves(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay, grad_scale, fused):
    """One AdamW step on lists of leaves, by the fused kernel where asked and available."""
    if fused and p and fused_adamw_available(p[0].device):
        _fused_adamw(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay, grad_scale)
    else:
        _scale(g, grad_scale)
        _adamw(p, g, m, v, decays, count, lr, beta1, beta2, eps, weight_decay)


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


# Newton-Schulz coefficients that orthogonalize in five steps (Jordan et al. 2024, "Muon"):
# they push every singular value into roughly [0.7, 1.2] rather than exactly to 1, which
# trains as well and takes fewer steps.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def muon_mask(params: Tree) -> Tree:
    """A tree of bools like `params`: True for the hidden matrices Muon updates (every tensor
    of two or more dimensions but the embeddings and the output head, whose rows are looked up
    one token at a time and want AdamW's per-coordinate steps)."""

    def is_hidden_matrix(path: str, t: torch.Tensor) -> bool:
        return t.dim() >= 2 and "embed_tokens" not in path and "lm_head" not in path

    return _path_mask(params, is_hidden_matrix, lambda t: t.dim() >= 2)  # nested: every matrix


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `g` (U V^T of its SVD), approximately, by a quintic
    Newton-Schulz iteration over its last two dimensions (leading ones are a batch: MoE experts,
    or same-shaped matrices stacked). Wide orientation inside, so each Gram product is the small
    one. In bf16 where the device multiplies it natively (the iteration tolerates its rounding;
    2x float32's speed on an AVX-512 BF16 CPU), else in float32."""
    a, b, c = NEWTON_SCHULZ
    x = g.to(torch.bfloat16 if native_bf16(g.device) else torch.float32)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    batched = x.unsqueeze(0) if x.dim() == 2 else x.flatten(0, -3)
    for _ in range(steps):
        gram = batched @ batched.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        batched = torch.baddbmm(batched, poly, batched, beta=a)  # a * x + poly @ x
    x = batched.reshape(x.shape)
    return (x.mT if tall else x).to(g.dtype)


def muon_scale(shape: torch.Size) -> float:
    """Muon's step on a matrix of this shape, relative to the learning rate: 0.2 * sqrt(max
    dimension) gives its update the root-mean-square of a typical AdamW update (Liu et al.
    2025, "Muon is Scalable for LLM Training"), so one learning rate serves both groups."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    beta1: float = 0.9,
    beta2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Tree | None = None,
    matrices: Tree | None = None,
    fused: bool = False,
) -> Optimizer:
    """Muon (MomentUm Orthogonalized by Newton-Schulz) on the hidden matrices, AdamW on the rest.

    Each matrix steps along its momentum made (nearly) orthogonal: every direction of the
    update gets the same size, so the rare directions the gradient underweights learn as fast
    as the common ones, and a given loss comes in fewer steps than with AdamW (the demo's
    pretraining: AdamW's loss at step 500 by step 250; docs/training.md). Per matrix:
    buf <- lerp(buf, g, 1 - momentum); u <- lerp(g, buf, momentum) with Nesterov, else buf;
    p <- p * (1 - lr * wd) - lr * muon_scale * NS(u), as `torch.optim.Muon` with
    adjust_lr_fn="match_rms_adamw". `matrices` is the tree of bools choosing Muon's tensors
    (default `muon_mask(params)`), `mask` the weight-decay mask.
    """

    def chosen(params: Tree) -> list[bool]:
        return _mask_leaves(params, matrices if matrices is not None else muon_mask(params))

    def init(params: Tree) -> MuonState:
        flat, spec = tree_flatten(params)
        v = [t.new_zeros(0) if c else torch.zeros_like(t) for t, c in zip(flat, chosen(params))]
        return MuonState(0, tree_map(torch.zeros_like, params), tree_unflatten(v, spec))

    def update(
        params: Tree, grads: Tree, state: MuonState, lr: float, grad_scale: float = 1.0
    ) -> tuple[Tree, MuonState]:
        p = tree_flatten(params)[0]
        g, m, v = (leaves_like(t, params) for t in (grads, state.m, state.v))
        decays, is_matrix = _mask_leaves(params, mask), chosen(params)

        def part(leaves: list, of_matrices: bool) -> list:
            return [x for x, c in zip(leaves, is_matrix) if c == of_matrices]

        count = state.count + 1
        if not all(is_matrix):
            adam_leaves = (part(xs, False) for xs in (p, g, m, v, decays))
            hyper = (lr, beta1, beta2, eps, weight_decay, grad_scale, fused)
            _adam_leaves(*adam_leaves, count, *hyper)
        if any(is_matrix):
            mp, mg, mm, md = (part(xs, True) for xs in (p, g, m, decays))
            _scale(mg, grad_scale)
            _decay(mp, md, lr, weight_decay)
            _muon(mp, mg, mm, lr, momentum, nesterov, ns_steps)
        return params, state._replace(count=count)

    return Optimizer(init, update)


def _muon(p, g, buf, lr, momentum, nesterov, ns_steps):
    """Muon's momentum and orthogonalized step on lists of matrices (decay already applied)."""
    torch._foreach_lerp_(buf, g, 1.0 - momentum)
    directions = torch._foreach_lerp(g, buf, momentum) if nesterov else buf
    # Same-shaped matrices (a layer's q and o, every layer's MLP) are orthogonalized as one
    # batch: a few large products instead of many small calls.
    by_shape: dict[tuple, list[int]] = {}
    for i, d in enumerate(directions):
        by_shape.setdefault(tuple(d.shape), []).append(i)
    for shape, group in by_shape.items():
        stacked = torch.stack([directions[i] for i in group])
        ortho = orthogonalize(stacked, ns_steps).unbind(0)
        torch._foreach_add_([p[i] for i in group], ortho, alpha=-lr * muon_scale(shape))


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
        "muon": lambda: muon(
            opt_cfg.muon_momentum,
            beta1=opt_cfg.beta1,
            beta2=opt_cfg.beta2,
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
            mask=mask,
            fused=opt_cfg.fused,
        ),
    }
    return builders[opt_cfg.name]()
