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

The expert layers lay the same world out a second way (Megatron-Core's "MoE parallel folding"):
dp is folded into ep_size neighbours (`ep`: each holds other experts, and they trade tokens) and
dp_size / ep_size rows of them (`edp`: the ranks that hold the same experts), dp rank = edp_rank *
ep_size + ep_rank. Both layouts are lists of named axes, LAYOUTS, built and cut into groups by the
same two functions; an axis's name says which layout it is on (pp, cp and tp are on both).

    dp 4, ep 2:   dp ranks 0 1 2 3   ep groups [0 1] [2 3]   edp groups [0 2] [1 3]
"""

import math

import torch
import torch.distributed as dist

AXES = ["dp", "pp", "cp", "tp"]  # the grid's dimensions, outermost first: the last varies fastest
### begin Expert parallelism
FOLDS = {"dp": ["edp", "ep"]}  # an axis of AXES and the axes the expert layers cut it into
EXPERT_AXES = [part for axis in AXES for part in FOLDS.get(axis, [axis])]  # edp, ep, pp, cp, tp
LAYOUTS = [AXES, EXPERT_AXES]  # an axis belongs to the first that has it
NAMES = [part for axis in AXES for part in [axis, *FOLDS.get(axis, [])]]  # dp, edp, ep, pp, ...
### end Expert parallelism


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


def grid(world_size, tp_size, pp_size, dp_size, cp_size=1, ep_size=1, layout=AXES):
    """Global ranks laid out as a grid, one dimension per entry of `layout`, the last fastest."""
    sizes = {"tp": tp_size, "pp": pp_size, "dp": dp_size, "cp": cp_size}
    sizes |= {"ep": ep_size, "edp": dp_size // ep_size}
    return torch.arange(world_size).view([sizes[axis] for axis in layout])  # (dp, pp, cp, tp)


def layout_of(axes):
    """The layout whose grid has every one of `axes`."""
    layout = next((layout for layout in LAYOUTS if set(axes) <= set(layout)), None)
    if layout is None or not axes:
        names = " | ".join(", ".join(layout) for layout in LAYOUTS)
        raise ValueError(f"no layout has the axes {', '.join(axes) or '()'}; the layouts: {names}")
    return layout


def group_ranks(grid, *axes, layout=AXES):
    """Every group over `axes` (names from `layout`, in any order), one row of global ranks each:
    the ranks that share their coordinates on every other axis, listed in grid order."""
    unknown = [axis for axis in axes if axis not in layout]
    if unknown or not axes:
        raise ValueError(f"no axis {unknown or axes} in the grid; its axes are {', '.join(layout)}")
    inside = [dim for dim, axis in enumerate(layout) if axis in axes]
    across = [dim for dim in range(len(layout)) if dim not in inside]
    size = math.prod(grid.shape[dim] for dim in inside)
    # The other axes to the front, these to the back: each row then varies along `axes` only.
    return grid.permute(*across, *inside).reshape(-1, size)  # (groups, size)


class ProcessGroupManager:
    """This rank's place in the grid, and the process group of each axis it belongs to. `timeout`:
    how long a collective of these groups may wait (None: PyTorch's default, 30 minutes on gloo)."""

    def __init__(self, tp_size, pp_size, dp_size, cp_size=1, timeout=None, ep_size=1):
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        self._holders = {}  # (spread, axes) -> `holders`
        check_sizes(self.world_size, tp_size, pp_size, dp_size, cp_size)
        assert dp_size % ep_size == 0, (dp_size, ep_size)  # check_expert_parallel refuses it
        sizes = (self.world_size, tp_size, pp_size, dp_size, cp_size, ep_size)
        self.grids = {tuple(layout): grid(*sizes, layout=layout) for layout in LAYOUTS}
        self.grid = self.grids[tuple(AXES)]
        self._groups = {}  # axes, in grid order -> (this rank's group, its global ranks)
        # For each axis: this rank's coordinate along it and its size (`tp_rank`, `tp_size`), and
        # the group of the ranks that differ from it only along it (`tp_group`, `tp_group_ids`).
        for layout, ranks in self.grids.items():
            coords = (ranks == self.global_rank).nonzero()[0].tolist()
            for axis, coord, size in zip(layout, coords, ranks.shape, strict=True):
                setattr(self, f"{axis}_rank", coord)
                setattr(self, f"{axis}_size", size)
                group, ids = self.group(axis)
                setattr(self, f"{axis}_group", group)
                setattr(self, f"{axis}_group_ids", ids)
        # Those that hold the same weights: gradients are averaged and the optimizer sharded here.
        self.dp_cp_group, self.dp_cp_group_ids = self.group("dp", "cp")

        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp_size - 1
        self.pp_prev_rank = None if self.pp_is_first_stage else self.pp_group_ids[self.pp_rank - 1]
        self.pp_next_rank = None if self.pp_is_last_stage else self.pp_group_ids[self.pp_rank + 1]

    def group(self, *axes):
        """This rank's process group over `axes`, e.g. group("tp") or group("dp", "pp"), and its
        global ranks. Every rank must create every group, in the same order, even those it is not
        part of, so call it on every rank alike: the first call for some axes creates all their
        groups, the later ones return the group made then."""
        layout = layout_of(axes)
        rows = group_ranks(self.grids[tuple(layout)], *axes, layout=layout)
        key = tuple(axis for axis in layout if axis in axes)
        if key not in self._groups:
            for ranks in rows.tolist():
                group = dist.new_group(ranks, timeout=self.timeout)
                if self.global_rank in ranks:
                    self._groups[key] = group, ranks
        assert key in self._groups, (self.global_rank, key)
        return self._groups[key]

    ### begin Expert parallelism
    def holders(self, spread, axes):
        """The global ranks of this rank's group over `axes` that hold the same piece as this
        rank of a parameter spread over the axes `spread` (its record's, of either layout): the
        ranks at this rank's coordinate on each of them. Made once for each question."""
        key = (frozenset(spread), tuple(axes))
        if key not in self._holders:
            layout = layout_of(axes)
            rows = group_ranks(self.grids[tuple(layout)], *axes, layout=layout).tolist()
            mine = next(row for row in rows if self.global_rank in row)
            where = {}  # axis: every global rank's coordinate along it
            for layout, ranks in self.grids.items():
                for dim, axis in enumerate(layout):
                    index = torch.arange(ranks.shape[dim]).view(-1, *[1] * (ranks.dim() - dim - 1))
                    where[axis] = index.expand(ranks.shape).reshape(-1)  # grid order: rank order
            same = lambda rank: all(where[a][rank] == where[a][self.global_rank] for a in spread)
            self._holders[key] = [rank for rank in mine if same(rank)]
        return self._holders[key]

    def axes_of(self, axes, spread):
        """`axes` (of AXES) as the layout of a parameter spread over the axes `spread` names
        them, less those that spread it already: ("dp", "cp") is ("edp", "cp") for an expert,
        held over ep."""
        layout = layout_of(spread) if spread else AXES
        named = [part for axis in axes for part in ([axis] if axis in layout else FOLDS[axis])]
        return [axis for axis in named if axis not in spread]

    ### end Expert parallelism

    def __repr__(self):
        get = lambda axis, what: getattr(self, f"{axis}_{what}")
        where = " ".join(f"{axis} {get(axis, 'rank')}/{get(axis, 'size')}" for axis in AXES)
        groups = " ".join(f"{axis} group {get(axis, 'group_ids')}" for axis in reversed(AXES))
        return f"rank {self.global_rank}/{self.world_size}: {where} | {groups}"
