"""The 4D grid of ranks: data parallel x pipeline parallel x context parallel x tensor parallel.

Global rank r sits at (dp_rank, pp_rank, cp_rank, tp_rank) in a grid of shape (dp_size, pp_size,
cp_size, tp_size), with tp varying fastest, then cp: ranks 0, 1, ... first fill one
tensor-parallel group. Tensor parallelism all-reduces activations four times per layer (two
forward, two backward), so its ranks should be neighbours on the same node, on the fastest links;
context parallelism passes key/value blocks at every layer, so it comes next; data parallelism
talks once per step and can span nodes.

    world 8, dp 2 x pp 1 x cp 2 x tp 2:   dp_rank 0: cp 0 [0 1]  cp 1 [2 3]
                                          dp_rank 1: cp 0 [4 5]  cp 1 [6 7]

The grid is built from the list of its axes, AXES, and a group from the names of its axes: the
group of an axis (or of several) is the ranks that share this rank's coordinates on all the other
axes. A new axis is one more entry in the list (and one more size).

The cp ranks of one pipeline stage and tp slice hold the same weights, like the dp ranks, and each
trains on its own tokens: gradients are averaged, and the optimizer sharded, over the dp x cp
group of the (dp_size * cp_size) ranks that share this rank's pp and tp coordinates.

Expert parallelism borrows its ranks from dp: the dp ranks of a group are cut into ep_size
neighbours (`ep`: each holds other experts, and they trade tokens) and dp_size / ep_size rows of
them (`edp`: the ranks that hold the same experts). dp rank = edp_rank * ep_size + ep_rank.

    dp 4, ep 2:   dp ranks 0 1 2 3   ep groups [0 1] [2 3]   edp groups [0 2] [1 3]
"""

import math

import torch
import torch.distributed as dist

AXES = ["dp", "pp", "cp", "tp"]  # the grid's dimensions, outermost first: the last varies fastest


def check_sizes(world_size, tp_size, pp_size, dp_size, cp_size=1):
    """Refuse a grid that does not fit the world, with the numbers. Call it on every rank, before
    any collective, so that a bad launch exits at once everywhere instead of hanging."""
    sizes = [("tp_size", tp_size), ("pp_size", pp_size), ("dp_size", dp_size)]
    for name, size in [*sizes, ("cp_size", cp_size)]:
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    if tp_size * pp_size * dp_size * cp_size != world_size:
        raise ValueError(
            f"tp_size * pp_size * dp_size * cp_size = {tp_size} * {pp_size} * {dp_size} * "
            f"{cp_size} = {tp_size * pp_size * dp_size * cp_size}, but the world size is "
            f"{world_size} (torchrun --nproc_per_node x --nnodes)"
        )


def grid(world_size, tp_size, pp_size, dp_size, cp_size=1):
    """Global ranks laid out as a grid with one dimension per entry of AXES, the last fastest."""
    sizes = {"tp": tp_size, "pp": pp_size, "dp": dp_size, "cp": cp_size}
    return torch.arange(world_size).view([sizes[axis] for axis in AXES])  # (dp, pp, cp, tp)


def group_ranks(grid, *axes):
    """Every group over `axes` (names from AXES, in any order), one row of global ranks each: the
    ranks that share their coordinates on every other axis, listed in grid order."""
    unknown = [axis for axis in axes if axis not in AXES]
    if unknown or not axes:
        raise ValueError(f"no axis {unknown or axes} in the grid; its axes are {', '.join(AXES)}")
    inside = [dim for dim, axis in enumerate(AXES) if axis in axes]
    across = [dim for dim in range(len(AXES)) if dim not in inside]
    size = math.prod(grid.shape[dim] for dim in inside)
    # The other axes to the front, these to the back: each row then varies along `axes` only.
    return grid.permute(*across, *inside).reshape(-1, size)  # (groups, size)


class ProcessGroupManager:
    """This rank's place in the grid, and the process group of each axis it belongs to. `timeout`:
    how long a collective of these groups may wait (None: PyTorch's default, 30 minutes on gloo)."""

    def __init__(self, tp_size, pp_size, dp_size, cp_size=1, timeout=None, ep_size=1):
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        check_sizes(self.world_size, tp_size, pp_size, dp_size, cp_size)
        self.grid = grid(self.world_size, tp_size, pp_size, dp_size, cp_size)
        coords = (self.grid == self.global_rank).nonzero()[0].tolist()
        self._groups = {}  # axes, in grid order -> (this rank's group, its global ranks)
        # For each axis: this rank's coordinate along it and its size (`tp_rank`, `tp_size`), and
        # the group of the ranks that differ from it only along it (`tp_group`, `tp_group_ids`).
        for axis, coord, size in zip(AXES, coords, self.grid.shape, strict=True):
            setattr(self, f"{axis}_rank", coord)
            setattr(self, f"{axis}_size", size)
            group, ids = self.group(axis)
            setattr(self, f"{axis}_group", group)
            setattr(self, f"{axis}_group_ids", ids)
        # Those that hold the same weights: gradients are averaged and the optimizer sharded here.
        self.dp_cp_group, self.dp_cp_group_ids = self.group("dp", "cp")

        ### begin Expert parallelism
        assert dp_size % ep_size == 0, (dp_size, ep_size)  # check_expert_parallel refuses it
        self.ep_size, self.edp_size = ep_size, dp_size // ep_size
        self.ep_rank, self.edp_rank = self.dp_rank % ep_size, self.dp_rank // ep_size
        # The dp x cp ranks of this rank's group, (edp, ep, cp): ep's rows and edp x cp's.
        cube = group_ranks(self.grid, "dp", "cp").view(-1, self.edp_size, ep_size, cp_size)
        self.ep_group, self.ep_group_ids = self.subgroups(cube.permute(0, 1, 3, 2), ep_size)
        # Those that hold the same experts: their gradients are averaged and sharded here.
        edp_cp = cube.permute(0, 2, 1, 3)  # (groups, ep, edp, cp)
        self.edp_cp_group, self.edp_cp_group_ids = self.subgroups(edp_cp, self.edp_size * cp_size)
        # edp alone: what ZeRO-3 cuts an expert over, besides cp (Muon puts it together again).
        edp = cube.permute(0, 2, 3, 1)  # (groups, ep, cp, edp)
        self.edp_group, self.edp_group_ids = self.subgroups(edp, self.edp_size)
        ### end Expert parallelism

        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp_size - 1
        self.pp_prev_rank = None if self.pp_is_first_stage else self.pp_group_ids[self.pp_rank - 1]
        self.pp_next_rank = None if self.pp_is_last_stage else self.pp_group_ids[self.pp_rank + 1]

    def group(self, *axes):
        """This rank's process group over `axes`, e.g. group("tp") or group("dp", "pp"), and its
        global ranks. Every rank must create every group, in the same order, even those it is not
        part of, so call it on every rank alike: the first call for some axes creates all their
        groups, the later ones return the group made then."""
        rows = group_ranks(self.grid, *axes)
        key = tuple(axis for axis in AXES if axis in axes)
        if key not in self._groups:
            for ranks in rows.tolist():
                group = dist.new_group(ranks, timeout=self.timeout)
                if self.global_rank in ranks:
                    self._groups[key] = group, ranks
        assert key in self._groups, (self.global_rank, key)
        return self._groups[key]

    def subgroups(self, ranks, size):
        """Every group of `size` consecutive ranks of `ranks` (its last dims flattened), made on
        every rank in the same order; this rank's, and its global ranks."""
        mine = None
        for row in ranks.reshape(-1, size).tolist():
            group = dist.new_group(row, timeout=self.timeout)
            if self.global_rank in row:
                mine = group, row
        assert mine is not None, self.global_rank
        return mine

    def __repr__(self):
        get = lambda axis, what: getattr(self, f"{axis}_{what}")
        where = " ".join(f"{axis} {get(axis, 'rank')}/{get(axis, 'size')}" for axis in AXES)
        groups = " ".join(f"{axis} group {get(axis, 'group_ids')}" for axis in reversed(AXES))
        return f"rank {self.global_rank}/{self.world_size}: {where} | {groups}"
