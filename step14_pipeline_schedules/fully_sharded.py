"""ZeRO-3, fully sharded data parallelism: the parameters, their gradients and the optimizer state
all divided over the R ranks that hold the same weights (dp x cp).

Each parameter (its tensor-parallel slice) is cut along its rows into R equal pieces, and a rank
stores only its piece: `shard_parameters` writes that into the placement record (a Split over dp,
and one over cp, on dim 0) before any weight exists, so `to_empty` allocates 1/R of every
parameter, `init_weights` fills this rank's rows, and the checkpoint, the transformers import and
the gradient norm read the pieces as they read any other split.

A layer needs its whole weights only while it computes. The parameters are grouped into units:
each decoder layer, and each module outside them (the embedding, the final norm, lm_head; modules
that share a weight, a tied embedding and lm_head, share a unit). Around a unit's forward:

1. all-gather: every rank sends its pieces and receives the others', into one flat buffer that
   the unit's modules use as their weights (views into it);
2. the forward runs;
3. the buffer's memory is freed: the views, which autograd saved for backward, stay, empty.

When backward reaches the unit (a hook on its output's gradient), the buffer is gathered again
into the same memory, so the saved views see the weights once more; when autograd has put the
unit's whole gradient together (a hook after it accumulates), a reduce-scatter leaves each rank
the average of its rows only, which it adds to its piece's `.grad`, and the buffer is freed again.
While one unit computes, the next one's all-gather is already on its way (prefetch): in forward
the unit after it, in backward the one before.

Per parameter and rank, between steps: 4/R bytes of weights, 4/R of gradients, 8/R of AdamW
moments; during a step, the whole weights and gradient of the units in flight on top.
"""

# R ranks of the shard group

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from data_parallel import NOTHING_TO_WAIT_FOR
from placement import (
    Gradients,
    OnWhole,
    Split,
    full_shape,
    init_piece,
    place,
    placed_parameters,
    record_of,
)
from utils import log
from zero import optimizer_state_bytes


def check_zero_stage(parser, args):
    """Refuse, before anything runs, a --zero_stage that this layout cannot use."""
    if args.reshard_after_forward == "never" and args.zero_stage != 3:
        parser.error(
            f"--reshard_after_forward never keeps stage 3's gathered weights; with --zero_stage "
            f"{args.zero_stage} nothing is gathered: drop it, or use --zero_stage 3"
        )
    if args.zero_stage == 1:
        return
    if args.dp_size * args.cp_size == 1:
        parser.error(
            f"--zero_stage {args.zero_stage} shards over the dp x cp ranks, here {args.dp_size} x "
            f"{args.cp_size} = 1: nothing to shard. Use --dp_size 2 or more, or --zero_stage 1"
        )
    if args.dp_timeline is not None:
        parser.error(
            f"--dp_timeline records stage 1's buckets; with --zero_stage {args.zero_stage} use "
            f"--profile DIR"
        )
    if args.zero_stage == 3 and args.compile:
        parser.error(
            "--zero_stage 3 does not run under --compile here (its hooks swap each layer's "
            "weights in and out around the forward); drop --compile, or use --zero_stage 2"
        )


def shard_parameters(model, pgm, axes):
    """Cut each parameter's rows over the grid's `axes` ("dp", "cp"): a record of one Split per
    axis of more than one rank, outermost first, and a meta tensor of this rank's piece. Call it
    on the meta device, after every other technique has placed its parameters."""
    sizes = {axis: getattr(pgm, f"{axis}_size") for axis in axes}
    shards = [Split(axis, 0, getattr(pgm, f"{axis}_rank"), size) for axis, size in sizes.items()]
    shards = [split for split in shards if split.size > 1]
    ways = 1
    for split in shards:
        ways *= split.size
    for prefix, module in model.named_modules():
        names = [name for name, _ in module.named_parameters(recurse=False)]
        for name in names:
            param = getattr(module, name)
            rows = param.shape[0]
            if rows % ways:
                where = f"{prefix}.{name}" if prefix else name
                raise ValueError(
                    f"--zero_stage 3 cuts each parameter's rows over dp x cp = {ways} ranks, but "
                    f"{where} has {rows} rows on this rank (full shape "
                    f"{full_shape(param.shape, record_of(module, name))}); use a dp x cp that "
                    f"divides every parameter's rows"
                )
            place(module, name, *record_of(module, name), *shards)
            piece = torch.empty((rows // ways, *param.shape[1:]), device="meta")
            setattr(module, name, nn.Parameter(piece, requires_grad=param.requires_grad))
        if names and not hasattr(module, "init_parameter"):  # tp's layers have their own
            module.init_parameter = partial(init_piece, module)
    return model


class Unit:
    """Parameters gathered and freed together, around the forward of `modules` (a decoder layer;
    the embedding and lm_head when they are tied). `uses`: (module, name, piece) for every place a
    piece is a module's parameter (a tied weight: twice); the pieces, each once, are stored side
    by side in one flat `shard`, so that the all-gather sends it as it is."""

    def __init__(self, modules, uses, group):
        self.modules, self.uses, self.group = modules, uses, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.pieces = list({id(piece): piece for _, _, piece in uses}.values())
        numel = sum(piece.numel() for piece in self.pieces)
        device = self.pieces[0].device
        self.shard = torch.empty(numel, device=device)
        offset, self.where = 0, {}  # id(piece): where it starts in the shard
        for piece in self.pieces:  # the pieces become views of the shard, keeping their values
            self.shard[offset : offset + piece.numel()] = piece.detach().view(-1)
            piece.data = self.shard[offset : offset + piece.numel()].view_as(piece)
            self.where[id(piece)] = offset
            offset += piece.numel()
        # The whole weights: a leaf whose views the modules use while the unit is gathered, and
        # whose gradient autograd builds. Its memory exists only while it is gathered.
        self.full = torch.zeros(self.size * numel, device=device, requires_grad=True)
        self.free()
        self.full.register_post_accumulate_grad_hook(self.accumulated)
        # Gradients that reach `full` in one micro-batch's backward: 1, autograd summing every
        # use's; under a split backward (zero_bubble.py) each weight hands its own over in W.
        self.expect, self.arrived = 1, 0
        self.handle = None  # the all-gather in flight
        self.received = torch.empty(0, device=device)
        self.measure = lambda grad_bytes=0: None  # the wrapper's count of the bytes gathered
        self.reshard = True  # freed after each forward and backward, or kept till the step's end

    def bytes(self):
        """What the unit holds beyond its pieces: its whole weights, or their all-gather."""
        whole = self.full.untyped_storage().nbytes()
        return whole + self.received.numel() * self.received.element_size()

    def start_gather(self):
        """Start the all-gather (at once, asynchronously), unless it is gathered or on its way."""
        if self.handle is not None or self.gathered:
            return
        self.received = torch.empty(self.size * self.shard.numel(), device=self.shard.device)
        if self.size == 1:
            self.received.copy_(self.shard)
            self.handle = NOTHING_TO_WAIT_FOR
            return
        self.handle = dist.all_gather_single(
            self.received, self.shard, group=self.group, async_op=True
        )

    @torch.no_grad()
    def gather(self):
        """Wait for the all-gather and lay the rows out as the whole parameters: rank k's piece of
        each parameter is its k-th block of rows."""
        if self.gathered:
            return
        self.start_gather()
        self.handle.wait()
        self.handle = None
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        whole, received = self.full.data, self.received.view(self.size, -1)  # (R, N/R)
        offset = 0
        for piece in self.pieces:
            start, numel = self.where[id(piece)], piece.numel()
            whole[offset * self.size : (offset + numel) * self.size] = received[
                :, start : start + numel
            ].reshape(-1)
            offset += numel
        self.received = torch.empty(0, device=self.shard.device)
        self.gathered = True

    def use_whole(self):
        """The modules' parameters become views of the whole weights (for autograd: of `full`)."""
        offset, views = 0, {}
        for piece in self.pieces:
            shape = (piece.shape[0] * self.size, *piece.shape[1:])
            views[id(piece)] = self.full[offset * self.size : (offset + piece.numel()) * self.size]
            views[id(piece)] = views[id(piece)].view(shape)
            offset += piece.numel()
        for module, name, piece in self.uses:
            module._parameters[name] = views[id(piece)]

    def use_pieces(self):
        for module, name, piece in self.uses:
            module._parameters[name] = piece

    def free(self):
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def accumulated(self, full):
        """After autograd added a gradient to `full`: reduce-scatter once all of them are in."""
        self.arrived += 1
        if self.arrived == self.expect:
            self.arrived = 0
            self.reduce_scatter(full)

    @torch.no_grad()
    def reduce_scatter(self, full):
        """The unit's whole gradient is complete: each rank keeps the average of its rows, added
        to its pieces' `.grad`; the whole gradient and weights are freed."""
        grad, offset = full.grad, 0
        send = torch.empty(self.size, self.shard.numel(), device=grad.device)  # (R, N/R)
        for piece in self.pieces:
            start, numel = self.where[id(piece)], piece.numel()
            rows = grad[offset * self.size : (offset + numel) * self.size]
            send[:, start : start + numel] = rows.view(self.size, numel)
            offset += numel
        send /= self.size
        mine = torch.empty(self.shard.numel(), device=grad.device)
        if self.size == 1:
            mine.copy_(send.view(-1))
        else:
            dist.reduce_scatter_single(mine, send.view(-1), group=self.group)
        for piece in self.pieces:
            start = self.where[id(piece)]
            add = mine[start : start + piece.numel()].view_as(piece)
            piece.grad = add.clone() if piece.grad is None else piece.grad.add_(add)
        self.measure(grad.numel() * grad.element_size())  # the whole gradient, alive till here
        full.grad = None
        self.use_pieces()
        if self.reshard:
            self.free()


def units_of(model):
    """(modules, uses) of each unit: each decoder layer, and each module outside the layers that
    holds parameters, those that share one in the same unit."""
    layers = list(model.model.layers.values())
    inside = {id(m) for layer in layers for m in layer.modules()}
    units = []
    for module in model.modules():
        uses = [(module, n, p) for n, p in module.named_parameters(recurse=False)]
        if id(module) in inside or not uses:
            continue
        pieces = {id(p) for _, _, p in uses}
        shared = [u for u in units if pieces & {id(p) for _, _, p in u[1]}]
        if shared:  # a tied weight: one unit, gathered around either module
            shared[0][0].append(module)
            shared[0][1].extend(uses)
        else:
            units.append(([module], uses))
    for layer in layers:
        uses = [(m, n, p) for m in layer.modules() for n, p in m.named_parameters(recurse=False)]
        units.append(([layer], uses))
    return units


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 around this stage's forward (`module`, which runs `model`'s modules): the hooks on
    the model's modules gather each unit before it computes and free it after, so evaluation and
    sampling, which call the stage without this wrapper, gather too. The optimizer updates the
    pieces themselves (`shard` gives them as they are). `shard_axes`: the axes over which the
    parameters are cut (`shard_parameters`) and the gradients averaged. `reshard`: free a unit's
    weights after each of its forwards and backwards; False keeps them from the step's first
    forward to its end (fewer all-gathers over many micro-batches, the stage's whole weights
    held: torchtitan's reshard_after_forward for pipelines)."""

    def __init__(self, module, model, pgm, shard_axes, reshard=True, split_backward=False):
        super().__init__()
        self.module, self.shard_axes = module, shard_axes
        self.dp_group, _ = pgm.group(*shard_axes)
        self.units = [Unit(*unit, self.dp_group) for unit in units_of(model)]
        self.most_gathered = 0
        for unit in self.units:
            unit.measure, unit.reshard = self.measure, reshard
            if split_backward:  # W hands over each use's gradient apart: wait for them all
                unit.expect = len(unit.uses)
        order = self.forward_order(model)
        for i, unit in enumerate(order):
            after = order[i + 1] if i + 1 < len(order) else None
            before = order[i - 1] if i > 0 else None
            for module_ in unit.modules:
                module_.register_forward_pre_hook(partial(self.before_forward, unit, after))
                module_.register_forward_hook(partial(self.after_forward, unit, before))
        self.require_backward_grad_sync = True
        self.on_whole = OnWhole(module, pgm)  # Muon's: the pieces have records, as tp's slices

    def forward_order(self, model):
        """The units in the order this stage's forward runs them (a tied unit at its first use)."""
        unit_of = {id(module): unit for unit in self.units for module in unit.modules}
        inner, order = model.model, []
        modules = [
            inner.embed_tokens,
            *inner.layers.values(),
            inner.norm,
            model.lm_head,
        ]
        for module in modules:
            if module is None:
                continue
            unit = next(unit_of[id(m)] for m in module.modules() if id(m) in unit_of)
            if unit not in order:
                order.append(unit)
        assert len(order) == len(self.units), (len(order), len(self.units))
        return order

    def measure(self, grad_bytes=0):
        """The most bytes of whole weights (and one unit's whole gradient) held at once."""
        now = sum(unit.bytes() for unit in self.units) + grad_bytes
        self.most_gathered = max(self.most_gathered, now)

    def before_forward(self, unit, after, module, args):
        unit.gather()
        if after is not None:
            after.start_gather()  # prefetch: the next unit travels while this one computes
        self.measure()
        unit.use_whole()

    def after_forward(self, unit, before, module, args, output):
        unit.use_pieces()
        if unit.reshard:
            unit.free()
        if torch.is_grad_enabled() and output.requires_grad:  # backward will need it again
            output.register_hook(partial(self.before_backward, unit, before))
        return output

    def before_backward(self, unit, before, grad):
        unit.gather()
        if before is not None:
            before.start_gather()
        self.measure()
        # A recomputed forward (recompute.py) reads them, until reduce_scatter. Backward runs its
        # hooks without grad mode; the views must carry it, for the forward run again with it.
        with torch.enable_grad():
            unit.use_whole()
        return grad

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        """Every unit's reduce-scatter ran in backward, as its gradient was complete; nothing is
        left gathered (a prefetched unit that was not used is dropped)."""
        for unit in self.units:
            if unit.handle is not None:
                unit.gather()
            unit.free()

    def shard(self, params):
        return params  # the parameters are this rank's pieces already

    def sum_tied_gradients(self, tied):
        tied.sum_gradients()  # on the pieces: the first and last stage's copies are cut alike

    def gradients(self, tied):
        """This rank's gradients for placement's `clip_grad_norm`: the pieces, each spread over
        the axes of its record (tp, pp, and the shard axes); a tied copy on the last stage is not
        counted, and clipped all the same."""
        counted = {id(param) for param in tied.counted.parameters()}
        pieces = [
            (placed.param.grad, placed.axes)
            for placed in placed_parameters(self.module)
            if id(placed.param) in counted and placed.param.grad is not None
        ]
        grads = [param.grad for param in self.module.parameters() if param.grad is not None]
        return Gradients(pieces, grads, ("tp", "pp", *self.shard_axes), self.units[0].shard.device)

    def all_gather_parameters(self):
        pass  # a unit is gathered when it is used

    def gradient_bytes(self):
        """The bytes of the gradients this rank holds: its pieces'."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return sum(grad.numel() * grad.element_size() for grad in grads)

    def gather_optimizer_state(self, optimizer):
        """For a checkpoint: {piece: its AdamW state}, the state of this rank's rows."""
        return {param: optimizer.state[param] for param in self.module.parameters()}

    @torch.no_grad()
    def load_optimizer_state(self, optimizer, whole):
        """{piece: its AdamW state}, read for this rank's rows, into the optimizer."""
        state = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, param in enumerate(params):
            state["state"][i] = whole[param]
        optimizer.load_state_dict(state)


def log_held_bytes(model, optimizer, zero):
    """Logs, on every rank, what it holds between steps: the bytes of its parameters, of the
    gradients the optimizer read and of AdamW's moments; with ZeRO-3, also the most bytes of whole
    weights (and one unit's whole gradient) it held at once during the step. Returns them. AdamW
    creates its moments at the first step: call it after one."""
    held = {
        "parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
        "gradients": zero.gradient_bytes(),
        "optimizer": optimizer_state_bytes(optimizer),
    }
    line = ", ".join(f"{what} {size:,}" for what, size in held.items())
    if hasattr(zero, "most_gathered"):
        held["gathered_at_most"] = zero.most_gathered
        line += f"; whole weights gathered, at most {zero.most_gathered:,}"
    log(f"bytes held on this rank between steps: {line}", all_ranks=True)
    return held
