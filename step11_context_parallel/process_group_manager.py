"""The 4D grid of ranks: data parallel x pipeline parallel x context parallel x tensor parallel.

Global rank r sits at (dp_rank, pp_rank, cp_rank, tp_rank) in a grid of shape (dp_size, pp_size,
cp_size, tp_size), with tp varying fastest, then cp: ranks 0, 1, ... first fill one
tensor-parallel group. Tensor parallelism all-reduces activations four times per layer (two
forward, two backward), so its ranks should be neighbours on the same node, on the fastest links;
context parallelism passes key/value blocks at every layer, so it comes next; data parallelism
talks once per step and can span nodes.

    world 8, dp 2 x pp 1 x cp 2 x tp 2:   dp_rank 0: cp 0 [0 1]  cp 1 [2 3]
                                          dp_rank 1: cp 0 [4 5]  cp 1 [6 7]

The cp ranks of one pipeline stage and tp slice hold the same weights, like the dp ranks, and each
trains on its own tokens: gradients are averaged, and the optimizer sharded, over the dp x cp
group of the (dp_size * cp_size) ranks that share this rank's pp and tp coordinates.
"""

import torch
import torch.distributed as dist


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
    """Global ranks laid out as a (dp, pp, cp, tp) grid; tp varies fastest, then cp."""
    return torch.arange(world_size).view(dp_size, pp_size, cp_size, tp_size)  # (dp, pp, cp, tp)


class ProcessGroupManager:
    """This rank's place in the grid, and the process group of each axis it belongs to. `timeout`:
    how long a collective of these groups may wait (None: PyTorch's default, 30 minutes on gloo)."""

    def __init__(self, tp_size, pp_size, dp_size, cp_size=1, timeout=None):
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        check_sizes(self.world_size, tp_size, pp_size, dp_size, cp_size)
        self.grid = grid(self.world_size, tp_size, pp_size, dp_size, cp_size)
        coords = (self.grid == self.global_rank).nonzero()[0].tolist()
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = dp, pp, cp, tp = coords
        self.dp_size, self.pp_size, self.cp_size, self.tp_size = dp_size, pp_size, cp_size, tp_size

        # The ranks that share this rank's coordinates on the three other axes.
        self.tp_group_ids = self.grid[dp, pp, cp, :].tolist()
        self.pp_group_ids = self.grid[dp, :, cp, tp].tolist()
        self.dp_group_ids = self.grid[:, pp, cp, tp].tolist()
        self.cp_group_ids = self.grid[dp, pp, :, tp].tolist()
        # Every rank must create every group, in the same order, even those it is not part of.
        self.tp_group = self._new_group(self.grid.view(-1, tp_size))
        self.pp_group = self._new_group(self.grid.permute(0, 2, 3, 1).reshape(-1, pp_size))
        self.dp_group = self._new_group(self.grid.permute(1, 2, 3, 0).reshape(-1, dp_size))
        self.cp_group = self._new_group(self.grid.permute(0, 1, 3, 2).reshape(-1, cp_size))
        # Those that hold the same weights: gradients are averaged and the optimizer sharded here.
        self.dp_cp_group_ids = self.grid[:, pp, :, tp].flatten().tolist()
        self.dp_cp_group = self._new_group(
            self.grid.permute(1, 3, 0, 2).reshape(-1, dp_size * cp_size)
        )

        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp_size - 1
        self.pp_prev_rank = None if self.pp_is_first_stage else self.pp_group_ids[self.pp_rank - 1]
        self.pp_next_rank = None if self.pp_is_last_stage else self.pp_group_ids[self.pp_rank + 1]

    def _new_group(self, rows):
        mine = None
        for ranks in rows.tolist():
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.global_rank in ranks:
                mine = group
        assert mine is not None
        return mine

    def __repr__(self):
        return (
            f"rank {self.global_rank}/{self.world_size}: dp {self.dp_rank}/{self.dp_size} "
            f"pp {self.pp_rank}/{self.pp_size} cp {self.cp_rank}/{self.cp_size} "
            f"tp {self.tp_rank}/{self.tp_size} | tp group {self.tp_group_ids} "
            f"cp group {self.cp_group_ids} pp group {self.pp_group_ids} "
            f"dp group {self.dp_group_ids}"
        )
