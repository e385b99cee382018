"""ZeRO-1, the distributed optimizer: the optimizer state sharded over the data-parallel ranks.

With step 6's data parallelism every replica keeps the AdamW moments of every parameter (two fp32
numbers, 8 bytes per parameter) and repeats the same update. ZeRO stage 1 splits that work and
that memory dp_size ways. Each flat gradient bucket of step 6 is cut into dp_size equal contiguous
shards (the bucket padded with zeros to a multiple of dp_size):

1. backward's all-reduce becomes a reduce-scatter: dp rank r receives the averaged gradient of
   shard r only, the other shards of its buffer are left as they were;
2. rank r updates shard r of the parameters with AdamW, whose moments exist for shard r only;
3. an all-gather brings every rank every updated shard.

A ring all-reduce is a reduce-scatter followed by an all-gather, so the bytes on the wire are those
of step 6: the memory is saved for free. The fp32 parameters themselves stay whole on every rank
(this course trains fp32 weights under autocast); with bf16 weights, the fp32 master copy would be
sharded the same way, 4 more bytes per parameter.

The optimizer is PyTorch's AdamW, given views: for each parameter, the run of its elements that
falls in this rank's shard, with the matching run of the gradient buffer as its `.grad`. Its math
is elementwise, so updating pieces gives exactly the update of the whole parameter.

A tied embedding under pipeline parallelism (step 7) has a copy on the first and on the last stage,
whose gradients are summed. Each copy gets a bucket of its own, so both are cut at the same places
and dp rank r of one stage holds the same elements as dp rank r of the other: summing the two
shards over the embedding group sums the gradient.

Checkpoints keep step 9's format: at save time each moment is put together whole from its shards
through the same buffers (an all-gather, like the parameters), and at load time each rank takes
its piece of it, so a run resumes in any layout, dp_size and bucket size.
"""

from functools import partial

import torch
import torch.distributed as dist

from checkpoint import MOMENTS  # AdamW's and Muon's, elementwise like their parameter
from data_parallel import NOTHING_TO_WAIT_FOR, Bucket, DataParallelBucket
from muon import is_matrix, moments
from overlap_timeline import NO_TIMELINE
from placement import Gradients, placed_parameters, through_whole
from utils import log


class ShardedBucket(Bucket):
    """A bucket of step 6 whose flat fp32 buffer is split into dp_size equal shards: reduce-scatter
    instead of all-reduce, and after the update the same buffer carries the parameters back.
    ZeRO-2 (`stage` 2): the whole buffer exists only while a micro-batch's gradients fill it and
    travel; the rank keeps its shard alone, in `grad_shard`, where each micro-batch adds its own."""

    collective = "reduce-scatter"

    def __init__(self, params, dp_group, stage=1):
        dp_size, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        numel = sum(p.numel() for p in params)
        shard_size = -(-numel // dp_size)  # ceil: the buffer is padded to dp_size shards
        self.numel, self.stage, self.device = dp_size * shard_size, stage, params[0].device
        super().__init__(params, None, dp_group)
        self.start, self.end = dp_rank * shard_size, (dp_rank + 1) * shard_size  # this rank's
        self.offsets, offset = [], 0  # (param, where its elements start in the buffer)
        for param in params:
            assert param.is_contiguous() and param.dtype == torch.float32
            self.offsets.append((param, offset))
            offset += param.numel()
        if stage == 1:  # the whole buffer, for good; the shard is a view of it
            self.allocate()
            self.grad_shard = self.grad_data[self.start : self.end]
        else:
            self.grad_shard = torch.zeros(shard_size, device=self.device)

    def allocate(self):
        """The whole buffer, and each parameter's `main_grad`, its view into it."""
        if self.grad_data is None:
            self.grad_data = torch.zeros(self.numel, device=self.device)
            for param, offset in self.offsets:
                param.main_grad = self.grad_data[offset : offset + param.numel()].view_as(param)

    def sync_gradient(self):
        """Start the reduce-scatter and return at once. Stage 1: the output is this rank's shard
        of the input buffer itself, each rank's sum in place; stage 2: a buffer of one shard."""
        assert self.handle is None
        if self.dp_size == 1:  # one replica: the whole buffer is its shard, already summed
            self.handle = NOTHING_TO_WAIT_FOR
            return
        self.grad_data /= self.dp_size
        out = self.grad_shard if self.stage == 1 else torch.empty_like(self.grad_shard)
        self.received = out
        self.handle = dist.reduce_scatter_single(
            out, self.grad_data, group=self.dp_group, async_op=True
        )

    def wait(self):
        """Stage 2: once the shard has arrived, it is added to the rank's own, and the whole
        buffer is freed; the next micro-batch allocates it again."""
        if self.stage == 1 or self.grad_data is None:
            return super().wait() if self.stage == 1 else None
        super().wait()
        if self.dp_size == 1:
            self.grad_shard += self.grad_data[self.start : self.end]
        else:
            self.grad_shard += self.received
        self.grad_data = self.received = self.handle = None
        self.ready = set()
        for param, _ in self.offsets:
            del param.main_grad

    def reset(self):
        if self.stage == 1:
            return super().reset()
        self.ready, self.handle, self.grad_data = set(), None, None
        self.grad_shard.zero_()

    def in_shard(self):
        """(param, first, lo, hi) for each parameter with elements in this rank's shard: buffer
        elements lo to hi, which are the flattened parameter's elements from `first` on."""
        for param, offset in self.offsets:
            lo, hi = max(offset, self.start), min(offset + param.numel(), self.end)
            if lo < hi:
                yield param, lo - offset, lo, hi

    def start_all_gather(self):
        """The gradients have been used: this rank's shard of the buffer takes its updated
        parameters, and the all-gather fills the rest of the buffer with the other ranks'.
        Stage 2 has no whole buffer left: one lives for the time of the all-gather."""
        buffer = self.grad_data if self.stage == 1 else torch.empty(self.numel, device=self.device)
        for param, first, lo, hi in self.in_shard():
            buffer[lo:hi] = param.view(-1)[first : first + hi - lo]
        self.gathered = buffer
        if self.dp_size == 1:  # the shard is the whole buffer: nothing to gather
            return NOTHING_TO_WAIT_FOR
        shard = buffer[self.start : self.end]
        return dist.all_gather_single(buffer, shard, self.dp_group, async_op=True)

    def copy_parameters_out(self):
        for param, offset in self.offsets:
            param.copy_(self.gathered[offset : offset + param.numel()].view_as(param))
        self.gathered = None


class ShardedBucketManager:
    """Step 6's buckets, in the same order (that of backward), each split over the dp ranks."""

    def __init__(self, params, dp_group, bucket_size, alone=None, stage=1):
        """`alone`: a parameter given a bucket of its own (the tied embedding's copy)."""
        groups, size = [[]], 0
        for param in reversed(params):
            full = size + param.numel() * 4 > bucket_size  # 4 bytes: fp32 gradients
            if groups[-1] and (full or param is alone or groups[-1][-1] is alone):
                groups, size = [*groups, []], 0
            groups[-1].append(param)
            size += param.numel() * 4
        self.buckets = [ShardedBucket(group, dp_group, stage) for group in groups]
        self.bucket_of = {param: i for i, group in enumerate(groups) for param in group}

    def mark_ready(self, param):
        self.buckets[self.bucket_of[param]].mark_ready(param)

    def wait(self):
        for bucket in self.buckets:  # in a fixed order on every rank, as in step 6
            bucket.wait()

    def reset(self):
        for bucket in self.buckets:
            bucket.reset()


class DataParallelZero1(DataParallelBucket):
    """Data parallelism with the optimizer sharded: step 6's buckets reduce-scattered during
    backward; the optimizer holds only this rank's shard (`shard`), clipped by the whole model's
    norm (`gradients`, for placement's clip_grad_norm); `all_gather_parameters` after the
    update. `shard_axes`: the axes of the grid (`pgm`) whose ranks hold the same weights, over
    which gradients are averaged and the optimizer sharded. `tied_weight`: this stage's copy of
    a tied embedding split between stages, or None. `stage` 2 (ZeRO-2): the gradients sharded
    too (`ShardedBucket`)."""

    def __init__(
        self,
        module,
        pgm,
        shard_axes,
        bucket_size_mb=25,
        tied_weight=None,
        timeline=NO_TIMELINE,
        stage=1,
    ):
        buckets = partial(ShardedBucketManager, alone=tied_weight, stage=stage)
        dp_group, _ = pgm.group(*shard_axes)
        super().__init__(module, dp_group, bucket_size_mb, timeline, buckets)
        self.shard_axes, self.stage, self.pgm = shard_axes, stage, pgm
        self.pieces = {}  # param: (the optimizer's view of its run in this rank's shard, first)

    def _accumulate_grad(self, param):
        """Stage 2: every micro-batch's gradients leave at once, as a bucket fills; a bucket's
        whole buffer is allocated again by its first gradient, once its last shard has arrived,
        and at most two buckets' buffers live at a time (the one filling, the one travelling)."""
        if self.stage == 1:
            return super()._accumulate_grad(param)
        manager = self.bucket_manager
        bucket = manager.buckets[manager.bucket_of[param]]
        if bucket.handle is not None:  # the last micro-batch's sum: to its shard first
            bucket.wait()
        bucket.allocate()
        param.main_grad.add_(param.grad)
        param.grad = None
        self.timeline.gradient_ready()
        bucket.mark_ready(param)
        if bucket.handle is not None:  # it just left: the one before it is freed
            for other in manager.buckets:
                if other is not bucket and other.handle is not None:
                    other.wait()

    def finish_gradient_synchronization(self):
        """Wait for every bucket's reduce-scatter. No parameter gets a `.grad`: only this rank's
        shard of each gradient is averaged, and the optimizer reads it through `shard`."""
        with self.timeline.wait():
            self.bucket_manager.wait()

    def shard(self, params):
        """What the optimizer updates of `params` on this rank: a view of each run of their
        elements in this rank's shard, its averaged gradient as `.grad`."""
        wanted, pieces = {id(p) for p in params}, []
        for bucket in self.bucket_manager.buckets:
            for param, first, lo, hi in bucket.in_shard():
                if id(param) in wanted:
                    piece = param.detach().view(-1)[first : first + hi - lo]
                    piece.grad = bucket.grad_shard[lo - bucket.start : hi - bucket.start]
                    pieces.append(piece)
                    self.pieces[param] = (piece, first)
        return pieces

    def sum_tied_gradients(self, tied):
        """Step 9's TiedEmbeddings.sum_gradients on shards: the copy's bucket holds it alone, on
        both stages the same size, so this rank's shard sums with the same shard of the other."""
        if tied.weight is None:
            return
        bucket = self.bucket_manager.buckets[self.bucket_manager.bucket_of[tied.weight]]
        assert [param for param, _ in bucket.offsets] == [tied.weight]
        dist.all_reduce(bucket.grad_shard, group=tied.group)

    def gradients(self, tied):
        """This rank's gradients for placement's `clip_grad_norm`, though each rank holds only
        its shard of the gradient: each run of a parameter in this rank's shard is a piece of it,
        spread over the axes of its placement and over the optimizer's `shard_axes`; a tied
        embedding's last-stage copy is left out of the norm (counted once). What this rank
        updates with, and clips: its grad_shards."""
        buckets, record = self.bucket_manager.buckets, {}
        for placed in placed_parameters(self.module):
            record[id(placed.param)] = placed.axes | set(self.shard_axes)
        counted = {id(param) for param in tied.counted.parameters()}
        pieces = [
            (bucket.grad_shard[lo - bucket.start : hi - bucket.start], record[id(param)])
            for bucket in buckets
            for param, _, lo, hi in bucket.in_shard()
            if id(param) in counted
        ]
        grads = [bucket.grad_shard for bucket in buckets]
        return Gradients(pieces, grads, (*self.shard_axes, "tp", "pp"), buckets[0].device)

    def gradient_bytes(self):
        """The bytes of the gradient buffers this rank holds: whole buckets at stage 1, the
        shards (and any whole bucket still alive) at stage 2."""
        buckets = self.bucket_manager.buckets
        held = [b.grad_data for b in buckets if b.grad_data is not None]
        held += [b.grad_shard for b in buckets] if self.stage == 2 else []
        return sum(t.numel() * t.element_size() for t in held)

    @torch.no_grad()
    def all_gather_parameters(self):
        """After optimizer.step(): every rank gets every shard of the updated parameters. All
        buckets start at once; each one's parameters are copied out as soon as it arrives."""
        handles = [bucket.start_all_gather() for bucket in self.bucket_manager.buckets]
        for bucket, handle in zip(self.bucket_manager.buckets, handles, strict=True):
            handle.wait()
            bucket.copy_parameters_out()

    @torch.no_grad()
    def gather_optimizer_state(self, optimizer):
        """For a checkpoint, on every dp rank: {parameter: its whole optimizer state}. Each moment
        is put together from the shards through a buffer laid out like the bucket's, as the
        parameters are. Holds every moment whole for the time of the save."""
        states = list(optimizer.state.values())
        assert states, "the optimizer has no state before its first step"
        names = {id(placed.param): placed.name for placed in placed_parameters(self.module)}
        whole = {}
        for bucket in self.bucket_manager.buckets:
            kept = {p: moments(optimizer, names[id(p)], p.ndim) for p, _ in bucket.offsets}
            for moment in (m for m in MOMENTS if any(m in kind for kind in kept.values())):
                flat = torch.zeros(bucket.numel, device=bucket.device)
                for param, _, lo, hi in bucket.in_shard():
                    if moment in kept[param]:
                        flat[lo:hi] = optimizer.state[self.pieces[param][0]][moment]
                shard = flat[bucket.start : bucket.end].clone()
                dist.all_gather_single(flat, shard, self.dp_group)
                for param, offset in bucket.offsets:
                    state = whole.setdefault(param, {"step": states[0]["step"].clone()})
                    if moment in kept[param]:
                        state[moment] = flat[offset : offset + param.numel()].view_as(param).clone()
        return whole

    @torch.no_grad()
    def on_whole(self, pieces, updates, fn):
        """Muon's `on_whole` (muon.py) for the optimizer's pieces of this rank's shard. No rank
        holds a whole matrix: each bucket that holds one has its updates all-gathered through a
        buffer laid out like it (as the parameters are after the step), each matrix is put
        together from its tp slices, `fn` applied on every rank that holds a piece (the same
        work on each), and the run of the result in this rank's shard kept. Every rank takes part
        in every gather, even one that holds no piece of a bucket."""
        update_of = {id(p): update for p, update in zip(pieces, updates, strict=True)}
        placed = {id(placed.param): placed for placed in placed_parameters(self.module)}
        done = {}
        for bucket in self.bucket_manager.buckets:
            if not any(is_matrix(placed[id(p)].name, p.ndim) for p, _ in bucket.offsets):
                continue
            flat = torch.zeros(
                bucket.dp_size * bucket.grad_shard.numel(), device=bucket.grad_shard.device
            )
            mine = [run for run in bucket.in_shard() if id(self.pieces[run[0]][0]) in update_of]
            for param, _, lo, hi in mine:
                flat[lo:hi] = update_of[id(self.pieces[param][0])]
            shard = flat[bucket.start : bucket.end].clone()
            dist.all_gather_single(flat, shard, self.dp_group)
            for param, first, lo, hi in mine:
                offset = lo - first  # where the parameter starts in the buffer
                update = flat[offset : offset + param.numel()].view_as(param)
                result = through_whole(update, placed[id(param)].record, self.pgm, fn)
                done[id(self.pieces[param][0])] = result.reshape(-1)[first : first + hi - lo]
        return [done[id(p)] for p in pieces]

    @torch.no_grad()
    def load_optimizer_state(self, optimizer, whole):
        """The other way: from {parameter: its whole AdamW state}, this rank's pieces of it."""
        state = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        position = {id(p): i for i, p in enumerate(params)}  # how state_dict() numbers them
        for param, (piece, first) in self.pieces.items():
            run, saved = slice(first, first + piece.numel()), whole[param]
            held = {m: saved[m].reshape(-1)[run].clone() for m in MOMENTS if m in saved}
            state["state"][position[id(piece)]] = {"step": whole[param]["step"], **held}
        optimizer.load_state_dict(state)  # moves each tensor to its piece's device


def optimizer_state_bytes(optimizer):
    """The bytes of this rank's AdamW moments (exp_avg and exp_avg_sq)."""
    return sum(
        state[key].numel() * state[key].element_size()
        for state in optimizer.state.values()
        for key in MOMENTS
        if key in state
    )


def log_optimizer_state(optimizer, zero):
    """Logs, on every rank, the bytes of its AdamW moments, a shard of those of its stage and tp
    slice; returns them. AdamW creates its moments at the first step: call it after one."""
    size, shards = optimizer_state_bytes(optimizer), dist.get_world_size(zero.dp_group)
    log(
        f"optimizer state: {size:,} bytes of AdamW moments on this rank, 1/{shards} of those of "
        f"its stage and tp slice",
        all_ranks=True,
    )
    return size
