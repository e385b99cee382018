"""Muon for the blocks' weight matrices, AdamW for the rest (--optimizer muon).

For a matrix W with gradient G, Muon keeps a momentum M, an exponential average of the gradients
(AdamW's first moment, with beta1 = momentum), and steps along an orthogonalised update:

    M <- momentum * M + (1 - momentum) * G
    U  = (1 - momentum) * G + momentum * M               Nesterov: a look one step ahead
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * NS(U)

NS(U), five Newton-Schulz iterations, is close to the matrix U V^T of U's singular value
decomposition U = U S V^T: every direction of the update gets about the same step, where the raw
gradient is dominated by a few. The embedding, lm_head and the norms are no matrices of a linear
map from hidden states to hidden states; they keep AdamW, with --learning_rate, while the
matrices take --muon_learning_rate.

Every step but NS works element by element, so it runs on whatever piece of W a rank holds. NS
needs the whole matrix: `on_whole(params, updates, fn)` gives this rank's pieces of `fn` applied to
the whole matrix of each update. On one device the pieces are the matrices; a layout that splits
a matrix over ranks puts it together first, from every rank's piece.
"""

import math
from functools import partial

import torch
from torch.optim.adamw import adamw

MOMENTS = {"muon": ["momentum_buffer"], "adamw": ["exp_avg", "exp_avg_sq"]}
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # as torch.optim.Muon's: a quintic, steep at zero


def is_matrix(name, ndim):
    """Whether Muon updates the parameter `name` with `ndim` dims: the decoder layers' matrices."""
    return ndim == 2 and ".layers." in f".{name}"


def moments(optimizer, name, ndim):
    """The names of the state that `optimizer` keeps for the parameter `name`, each shaped like
    it: Muon's momentum for a decoder layer's matrix in a run of Muon, else AdamW's two moments."""
    muon = any(group.get("muon") for group in optimizer.param_groups)
    return MOMENTS["muon" if muon and is_matrix(name, ndim) else "adamw"]


def orthogonalise(update, ns_steps=5, dtype=torch.float32, eps=1e-7):
    """NS(update) scaled by sqrt(max(1, rows / cols)), for a whole matrix. In float32 here, so
    that layouts compare to float32's rounding; on a GPU bfloat16 is faster and is what
    torch.optim.Muon uses (`dtype=torch.bfloat16` reproduces it)."""
    rows, cols = update.shape
    x = update.to(dtype)
    x = x.T if rows > cols else x  # the Gram matrix of the shorter side: (min, min)
    x = x / x.norm().clamp(min=eps)  # singular values at most 1, where the iteration converges
    a, b, c = NS_COEFFICIENTS
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.T if rows > cols else x
    return x.to(update.dtype) * math.sqrt(max(1, rows / cols))


def one_device(params, updates, fn):
    """`on_whole` where every parameter is whole on this rank."""
    return [fn(update) for update in updates]


class Muon(torch.optim.Optimizer):
    """One optimizer for both: groups with "muon": True take Muon's step, the others AdamW's
    (PyTorch's own, fused where it can be). `groups`: param groups as torch.optim.AdamW takes
    them, each with its "muon"."""

    def __init__(self, groups, lr, momentum=0.95, betas=(0.9, 0.95), on_whole=one_device, **kw):
        defaults = dict(lr=lr, weight_decay=0.0, momentum=momentum, betas=betas, eps=1e-8)
        super().__init__(groups, defaults)
        self.on_whole = on_whole
        self.ns_dtype = kw.get("ns_dtype", torch.float32)  # bfloat16: torch.optim.Muon's NS

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    for moment in MOMENTS["muon" if group["muon"] else "adamw"]:
                        state[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)
            (self.muon if group["muon"] else self.adamw)(group, params)

    def muon(self, group, params):
        momentum, lr = group["momentum"], group["lr"]
        updates = []
        for p in params:
            state = self.state[p]
            state["step"] += 1
            state["momentum_buffer"].lerp_(p.grad, 1 - momentum)
            updates.append(p.grad.lerp(state["momentum_buffer"], momentum))
        # Every rank calls on_whole, even one that holds no piece: it may gather from the others.
        fn = partial(orthogonalise, dtype=self.ns_dtype)
        for p, step in zip(params, self.on_whole(params, updates, fn), strict=True):
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(step, alpha=-lr)

    def adamw(self, group, params):
        if not params:
            return
        state = [self.state[p] for p in params]
        for s in state:  # fused AdamW counts steps on the parameter's device (after a resume too)
            s["step"] = s["step"].to(params[0].device)
        fused = all(p.device.type in ("cuda", "cpu") for p in params) or None
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in state],
            [s["exp_avg_sq"] for s in state],
            [],
            [s["step"] for s in state],
            fused=fused,
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def muon_groups(model, args, shard=list):
    """The param groups of --optimizer muon: the blocks' matrices (Muon, --muon_learning_rate),
    the other matrices (AdamW, with weight decay) and the vectors (AdamW, none). `shard`: what
    this rank updates of a list of parameters (a layout may give it pieces of them)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_matrix(n, p.ndim)]
    others = [p for n, p in named if not is_matrix(n, p.ndim) and p.ndim >= 2]
    vectors = [p for n, p in named if p.ndim < 2]
    wd = args.weight_decay
    return [
        {
            "params": shard(matrices),
            "muon": True,
            "lr": args.muon_learning_rate,
            "weight_decay": wd,
        },
        {"params": shard(others), "muon": False, "weight_decay": wd},
        {"params": shard(vectors), "muon": False, "weight_decay": 0.0},
    ]


def make_optimizer(model, args, device, shard=list, on_whole=one_device):
    """--optimizer adamw: PyTorch's AdamW, weight decay on matrices only (not norms); muon: `Muon`
    over `muon_groups`. `shard`: what this rank updates of a list of parameters; `on_whole`: how
    Muon gets whole matrices from this rank's pieces. The optimizer says what it keeps for a
    parameter (`state_names(name, ndim)`: `moments`), which a checkpoint asks."""
    if args.optimizer == "muon":
        optimizer = Muon(muon_groups(model, args, shard), lr=args.learning_rate, on_whole=on_whole)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        decay = args.weight_decay
        groups = [
            {"params": shard([p for p in params if p.ndim >= 2]), "weight_decay": decay},
            {"params": shard([p for p in params if p.ndim < 2]), "weight_decay": 0.0},
        ]
        fused = device.type in ("cuda", "cpu")
        optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=fused)
    optimizer.state_names = partial(moments, optimizer)
    return optimizer
