"""Where each parameter lives on the grid of ranks: one record per parameter, written by the layer
that splits it, read by everything that has to know: the initial weights (this rank's piece of the
full tensor), the checkpoint (which rows or columns it saves and loads), the transformers import
and the gradient norm (over which ranks the squares are summed, each piece counted once).

A parameter with no record is whole on every rank. A technique that places a parameter in a new
way writes its own record; the readers stay as they are.

    place(layer, "weight", Split("tp", dim=0, rank=tp_rank, size=tp_size))
    place(layer, "weight", *record_of(layer, "weight"), Held("pp", rank=pp_rank))
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Split:
    """This rank holds piece `rank` of `size` equal pieces of the full tensor along `dim`, one per
    rank of the `axis` group ("tp": the tensor-parallel ranks)."""

    axis: str
    dim: int
    rank: int
    size: int


@dataclass(frozen=True)
class Held:
    """The whole tensor lives on rank `rank` of the `axis` group only; the other ranks of the group
    hold other parameters in its place (each pipeline stage its own layers)."""

    axis: str
    rank: int


def place(module, name, *record):
    """Record how `module`'s parameter `name` is placed: Splits (outermost first) and Helds. The
    record lives on the module, which keeps it when its parameters are allocated or replaced."""
    module.placements = {**getattr(module, "placements", {}), name: tuple(record)}


def record_of(module, name):
    """The record of `module`'s parameter `name`; () when it is whole on every rank."""
    return getattr(module, "placements", {}).get(name, ())


def full_shape(shape, record):
    """The full tensor's shape, from the shape of this rank's piece."""
    full = list(shape)
    for split in cuts(record):
        full[split.dim] *= split.size
    return full


def piece(full, record):
    """This rank's piece of the full tensor: each split cuts the piece left by the ones before."""
    for split in cuts(record):
        full = full.chunk(split.size, dim=split.dim)[split.rank]
    return full


def starts(shape, record):
    """{dim: where this rank's piece starts along it in the full tensor}, for every split dim."""
    first, size = {}, full_shape(shape, record)  # size: of what is left to cut, along each dim
    for split in cuts(record):
        size[split.dim] //= split.size
        first[split.dim] = first.get(split.dim, 0) + split.rank * size[split.dim]
    return first


def cuts(record):
    return [entry for entry in record if isinstance(entry, Split)]


def init_piece(module, name, make_full):
    """`init_parameter` (model.py's `init_weights` calls it) for a module whose parameters have
    records: the full tensor made from the seed, then this rank's piece of it."""
    record = record_of(module, name)
    return piece(make_full(full_shape(getattr(module, name).shape, record)), record)


@dataclass
class Placed:
    """One of this rank's parameters, as the whole model sees it."""

    name: str  # its name in the single-device model
    param: torch.nn.Parameter
    record: tuple  # of Split and Held; () when whole on every rank

    @property
    def shape(self):
        return full_shape(self.param.shape, self.record)

    @property
    def splits(self):
        return cuts(self.record)

    @property
    def axes(self):
        """The axes whose ranks hold other pieces of it, or other parameters in its place."""
        return {entry.axis for entry in self.record}


def placed_parameters(model):
    """This rank's parameters with their records, each once (a shared one under its first name)."""
    seen = set()
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield Placed(f"{prefix}.{name}" if prefix else name, param, record_of(module, name))


def gather(tensor, record, pgm):
    """The full tensor, from every rank's piece of it (this rank's: `tensor`): an all-gather over
    each split's axis, the last split first, so each one undoes a cut of `piece`."""
    for split in reversed(cuts(record)):
        group, _ = pgm.group(split.axis)
        pieces = [torch.empty_like(tensor) for _ in range(split.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        tensor = torch.cat(pieces, dim=split.dim)
    return tensor


def through_whole(tensor, record, pgm, fn):
    """This rank's piece of `fn` applied to the full tensor of which `tensor` is its piece."""
    return piece(fn(gather(tensor, record, pgm)), record)


class OnWhole:
    """Muon's `on_whole` (muon.py) for the parameters of `model`, found by their records: each
    update put together whole, `fn` applied to it on every rank that holds a piece (the same
    work on each: the price of not sending the result back), and this rank's piece kept."""

    def __init__(self, model, pgm):
        self.model, self.pgm = model, pgm

    def __call__(self, params, updates, fn):
        placed = {id(placed.param): placed.record for placed in placed_parameters(self.model)}
        records = [placed[id(param)] for param in params]
        return [
            through_whole(update, record, self.pgm, fn)
            for update, record in zip(updates, records, strict=True)
        ]


def grad_norm(pieces, pgm, axes, device=None):
    """The norm of the whole model's gradient from this rank's `pieces`, pairs (gradient, the axes
    it is spread over: `Placed.axes`, and a sharded optimizer's axes for its shard of it). `axes`:
    every axis over which the pieces differ. Each piece counts once: on the ranks at coordinate 0
    of every axis it is not spread over (a weight whole on every tp rank counts on tp rank 0),
    and adds zero elsewhere, or nan where it is not finite on that rank alone: a fault that one
    rank sees reaches every rank's norm. Then one sum over `axes`, skipped where they hold one
    rank. `device`: where the sum is made, when this rank may have no piece (a shard of the
    optimizer can hold none)."""
    pieces = list(pieces)
    counted = torch.zeros((), device=device or pieces[0][0].device)
    for grad, spread in pieces:
        squares = grad.float().pow(2).sum()
        if all(getattr(pgm, f"{axis}_rank") == 0 for axis in axes if axis not in spread):
            counted += squares
        else:  # counted elsewhere: 0 here, exactly, unless not finite on this rank alone (nan)
            counted += squares * 0.0
    used = [axis for axis in axes if getattr(pgm, f"{axis}_size") > 1]
    if used:
        dist.all_reduce(counted, group=pgm.group(*used)[0])
    return counted.sqrt()


@dataclass
class Gradients:
    """This rank's gradients as clipping takes them: `pieces`, pairs (gradient, the axes it is
    spread over) from which `grad_norm` makes the whole model's norm, each counted once; `grads`,
    the tensors this rank updates with, all scaled; `axes`, those over which the pieces differ;
    `device`, where the norm is summed (a rank may hold no piece)."""

    pieces: list
    grads: list
    axes: tuple
    device: torch.device | None = None


def model_gradients(model, axes, counted=None):
    """The gradients of `model`'s parameters, each a piece spread over its record's axes;
    `counted`: the parameters the norm counts (all of `model`'s; a later step leaves out a
    copy), every one clipped all the same."""
    params = [p for p in placed_parameters(model) if p.param.grad is not None]
    counted = {id(p) for p in (model if counted is None else counted).parameters()}
    pieces = [(p.param.grad, p.axes) for p in params if id(p.param) in counted]
    return Gradients(pieces, [p.param.grad for p in params], tuple(axes))


def clip_grad_norm(gradients, max_norm, pgm):
    """Clip by the norm of the whole model's gradient, not of this rank's pieces: the norm from
    the pieces (`grad_norm`), then every gradient this rank updates with scaled by max_norm /
    (norm + 1e-6) where that is below 1, as torch.nn.utils.clip_grad_norm_ does. Returns the
    norm. The one clip of every step from 4 on: a layout only says what its gradients are."""
    total_norm = grad_norm(gradients.pieces, pgm, gradients.axes, gradients.device)
    clip = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in gradients.grads:
        grad.mul_(clip)
    return total_norm
