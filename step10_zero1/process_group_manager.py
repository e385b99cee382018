"""The 3D grid of ranks: data parallel x pipeline parallel x tensor parallel.

Global rank r sits at (dp_rank, pp_rank, tp_rank) in a grid of shape (dp_size, pp_size, tp_size),
with tp varying fastest: ranks 0, 1, ... first fill one tensor-parallel group. Tensor parallelism
all-reduces activations four times per layer (two forward, two backward), so its ranks should be
neighbours on the same node, on the fastest links; data parallelism talks once per step and can
span nodes.

    world 8, dp 2 x pp 2 x tp 2:   dp_rank 0: pp 0 [0 1]  pp 1 [2 3]
                                   dp_rank 1: pp 0 [4 5]  pp 1 [6 7]
"""

import torch
import torch.distributed as dist


def check_sizes(world_size, tp_size, pp_size, dp_size):
    """Refuse a grid that does not fit the world, with the numbers. Call it on every rank, before
    any collective, so that a bad launch exits at once everywhere instead of hanging."""
    for name, size in [("tp_size", tp_size), ("pp_size", pp_size), ("dp_size", dp_size)]:
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    if tp_size * pp_size * dp_size != world_size:
        raise ValueError(
            f"tp_size * pp_size * dp_size = {tp_size} * {pp_size} * {dp_size} = "
            f"{tp_size * pp_size * dp_size}, but the world size is {world_size} "
            f"(torchrun --nproc_per_node x --nnodes)"
        )


def grid(world_size, tp_size, pp_size, dp_size):
    """Global ranks laid out as a (dp, pp, tp) grid; tp varies fastest."""
    return torch.arange(world_size).view(dp_size, pp_size, tp_size)  # (dp, pp, tp)


class ProcessGroupManager:
    """This rank's place in the grid, and the process group of each axis it belongs to. `timeout`:
    how long a collective of these groups may wait (None: PyTorch's default, 30 minutes on gloo)."""

    def __init__(self, tp_size, pp_size, dp_size, timeout=None):
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        check_sizes(self.world_size, tp_size, pp_size, dp_size)
        self.grid = grid(self.world_size, tp_size, pp_size, dp_size)
        coords = (self.grid == self.global_rank).nonzero()[0].tolist()
        self.dp_rank, self.pp_rank, self.tp_rank = coords
        self.dp_size, self.pp_size, self.tp_size = dp_size, pp_size, tp_size

        # The ranks that share this rank's coordinates on the two other axes.
        self.tp_group_ids = self.grid[self.dp_rank, self.pp_rank, :].tolist()
        self.pp_group_ids = self.grid[self.dp_rank, :, self.tp_rank].tolist()
        self.dp_group_ids = self.grid[:, self.pp_rank, self.tp_rank].tolist()
        # Every rank must create every group, in the same order, even those it is not part of.
        self.tp_group = self._new_group(self.grid.view(-1, tp_size))
        self.pp_group = self._new_group(self.grid.transpose(1, 2).reshape(-1, pp_size))
        self.dp_group = self._new_group(self.grid.permute(1, 2, 0).reshape(-1, dp_size))

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
            f"pp {self.pp_rank}/{self.pp_size} tp {self.tp_rank}/{self.tp_size} | "
            f"tp group {self.tp_group_ids} pp group {self.pp_group_ids} "
            f"dp group {self.dp_group_ids}"
        )
