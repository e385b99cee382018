"""The (dp, pp, tp) grid: every rank's coordinates and groups, and the refusal of bad sizes;
step 11's (dp, pp, cp, tp) grid: its groups from the names of their axes."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import CLEAN_FORK, assert_matches, import_step, run_step, spawn

pgm_lib = import_step("step2_process_group_manager", "process_group_manager")


def expected(rank, dp, pp, tp):
    """The grid by hand: rank = (dp_rank * pp + pp_rank) * tp + tp_rank."""
    dp_rank, rest = divmod(rank, pp * tp)
    pp_rank, tp_rank = divmod(rest, tp)
    at = lambda d, p, t: (d * pp + p) * tp + t
    return {
        "coords": [dp_rank, pp_rank, tp_rank],
        "tp": [at(dp_rank, pp_rank, t) for t in range(tp)],
        "pp": [at(dp_rank, p, tp_rank) for p in range(pp)],
        "dp": [at(d, pp_rank, tp_rank) for d in range(dp)],
    }


def worker(rank, world, sizes, results):
    from process_group_manager import ProcessGroupManager  # step 2's, imported by spawn

    tp, pp, dp = sizes
    pgm = ProcessGroupManager(tp_size=tp, pp_size=pp, dp_size=dp)
    # Each group really holds these ranks: an all-gather of global ranks over it.
    members = {}
    for axis in ["tp", "pp", "dp"]:
        group = getattr(pgm, f"{axis}_group")
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, rank, group=group)
        members[axis] = gathered
    results[rank] = {
        "coords": [pgm.dp_rank, pgm.pp_rank, pgm.tp_rank],
        "ids": {a: getattr(pgm, f"{a}_group_ids") for a in ["tp", "pp", "dp"]},
        "members": members,
        "stages": [pgm.pp_is_first_stage, pgm.pp_is_last_stage, pgm.pp_prev_rank, pgm.pp_next_rank],
    }


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 2), (2, 3, 1), (1, 2, 3)])
def test_grid_membership(tmp_path, tp, pp, dp):
    world = tp * pp * dp
    results = CLEAN_FORK.Manager().dict()
    spawn("step2_process_group_manager", worker, world, tmp_path, (tp, pp, dp), results)
    for rank in range(world):
        want, got = expected(rank, dp, pp, tp), results[rank]
        where = f"ProcessGroupManager.__init__ of rank {rank} at dp {dp} x pp {pp} x tp {tp}"
        assert got["coords"] == want["coords"], (
            f"{where}: (dp_rank, pp_rank, tp_rank) is {got['coords']}, expected {want['coords']}"
        )
        for axis in ["tp", "pp", "dp"]:
            assert got["ids"][axis] == want[axis], (
                f"{where}: {axis}_group_ids is {got['ids'][axis]}, expected {want[axis]}"
            )
            assert got["members"][axis] == want[axis], (
                f"{where}: an all-gather over {axis}_group reached {got['members'][axis]}, "
                f"expected {want[axis]} (ProcessGroupManager.group keeps this rank's group)"
            )
        pp_rank, pp_ids = want["coords"][1], want["pp"]
        prev = pp_ids[pp_rank - 1] if pp_rank > 0 else None
        following = pp_ids[pp_rank + 1] if pp_rank < pp - 1 else None
        stages = [pp_rank == 0, pp_rank == pp - 1, prev, following]
        assert got["stages"] == stages, (
            f"{where}: pp_is_first_stage, pp_is_last_stage, pp_prev_rank, pp_next_rank are "
            f"{got['stages']}, expected {stages}"
        )


def test_grid_layout_tp_fastest():
    """The grid of (dp, pp, tp), tp fastest, against the formula of `expected`; sizes that differ
    from each other, so that axes in the wrong order cannot pass for the right ones."""
    formula = "(dp_rank * pp + pp_rank) * tp + tp_rank"
    grid = pgm_lib.grid(8, tp_size=2, pp_size=2, dp_size=2)
    want = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert_matches(grid, want, "grid(8, tp 2, pp 2, dp 2)", rtol=0, atol=0, reference=formula)
    for dp, pp, tp in [(2, 3, 4), (3, 1, 2), (1, 3, 2), (3, 2, 1)]:
        world = dp * pp * tp
        want = torch.zeros(dp, pp, tp, dtype=torch.int64)
        for rank in range(world):
            want[tuple(expected(rank, dp, pp, tp)["coords"])] = rank
        grid = pgm_lib.grid(world, tp_size=tp, pp_size=pp, dp_size=dp)
        what = f"grid({world}, tp {tp}, pp {pp}, dp {dp})"
        assert_matches(grid, want, what, rtol=0, atol=0, reference=formula)


@pytest.mark.parametrize(
    "world, tp, pp, dp, message",
    [
        (2, 3, 1, 1, "3 \\* 1 \\* 1 = 3, but the world size is 2"),
        (4, 2, 1, 1, "2 \\* 1 \\* 1 = 2, but the world size is 4"),
        (2, 0, 1, 2, "tp_size must be at least 1, got 0"),
    ],
)
def test_check_sizes_message(world, tp, pp, dp, message):
    with pytest.raises(ValueError, match=message):
        pgm_lib.check_sizes(world, tp, pp, dp)


def test_bad_launch_fails_fast_on_every_rank():
    """torchrun with a grid that does not fit: non-zero exit, the numbers shown, no hang."""
    start = time.monotonic()
    result = run_step("step2_process_group_manager", ["--tp_size", "3"], nproc=2, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "tp_size * pp_size * dp_size = 3 * 1 * 1 = 3, but the world size is 2" in output
    # Each rank refuses before any collective, so nobody waits for a peer (torchrun stops the
    # other rank as soon as one fails, so its own message may not be printed).
    assert time.monotonic() - start < 60


def waits_at_a_barrier_alone(rank, world):
    if rank == 0:
        dist.barrier()
    else:
        time.sleep(60)


def returns(rank, world):
    pass


def test_a_hang_names_where_each_rank_waits(tmp_path):
    """The tests' process runner stops ranks that wait too long and says where each one was."""
    spawn("step2_process_group_manager", returns, 2, tmp_path)  # the server started, if it was not
    with pytest.raises(TimeoutError) as error:
        spawn("step2_process_group_manager", waits_at_a_barrier_alone, 2, tmp_path, timeout=6)
    rank0, rank1 = str(error.value).split("rank 1:")
    assert "in barrier" in rank0 and "waits_at_a_barrier_alone" in rank0
    assert "in barrier" not in rank1 and "waits_at_a_barrier_alone" in rank1


class RecordingDist:
    """torch.distributed for one rank of `world`, without processes: new_group records the ranks
    and options of every group created and returns its index in that record."""

    def __init__(self, rank, world):
        self.rank, self.world, self.created = rank, world, []

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world

    def new_group(self, ranks, **options):
        self.created.append((list(ranks), options))
        return len(self.created) - 1


def todays_groups(dp, pp, cp, tp):
    """The reference: the grid laid out by hand and each group's rows by a permute written for
    its axis, one row per group, in the order of creation."""
    grid = torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)
    rows = {
        "tp": grid.view(-1, tp),
        "pp": grid.permute(0, 2, 3, 1).reshape(-1, pp),
        "dp": grid.permute(1, 2, 3, 0).reshape(-1, dp),
        "cp": grid.permute(0, 1, 3, 2).reshape(-1, cp),
        "dp_cp": grid.permute(1, 3, 0, 2).reshape(-1, dp * cp),
    }
    return grid, {axis: r.tolist() for axis, r in rows.items()}


def built_by_names(step, rank, dp, pp, cp, tp):
    """Step `step`'s ProcessGroupManager of `rank`, its groups built from the axis names by its
    own code, with RecordingDist; and that RecordingDist."""
    module = import_step(step, "process_group_manager")
    module.dist = fake = RecordingDist(rank, dp * pp * cp * tp)
    sizes = {"tp_size": tp, "pp_size": pp, "dp_size": dp} | ({"cp_size": cp} if cp > 1 else {})
    return module.ProcessGroupManager(**sizes, timeout=timedelta(seconds=7)), fake


# Sizes that differ from each other: a group along the wrong axis cannot pass for the right one.
SHAPES = [(2, 3, 1, 4), (3, 1, 1, 2), (2, 2, 3, 1), (1, 3, 2, 2), (3, 2, 2, 1), (1, 1, 1, 1)]


def test_group_ranks_are_the_permuted_grids():
    """Step 2's group_ranks, given a grid laid out by hand: the groups of an axis, or of two
    named in any order, one row each, its ranks in grid order, as todays_groups permutes them."""
    for dp, pp, tp in [(2, 3, 4), (3, 1, 2), (1, 3, 2), (3, 2, 1), (2, 2, 2)]:
        grid, rows = todays_groups(dp, pp, 1, tp)
        grid = grid.view(dp, pp, tp)
        rows["dp_pp"] = grid.permute(2, 0, 1).reshape(-1, dp * pp).tolist()
        named = {("tp",): "tp", ("pp",): "pp", ("dp",): "dp", ("pp", "dp"): "dp_pp"}
        for axes, name in named.items():
            what = f"group_ranks(grid dp {dp} x pp {pp} x tp {tp}, {', '.join(map(repr, axes))})"
            got, want = pgm_lib.group_ranks(grid, *axes), torch.tensor(rows[name])
            assert_matches(got, want, what, rtol=0, atol=0, reference="the permuted grid")


@pytest.mark.parametrize("dp, pp, cp, tp", SHAPES)
def test_groups_from_axis_names_are_the_permuted_grids(dp, pp, cp, tp):
    """Steps 2 and 11 build, from the names of the axes, the rank layout and the groups that a
    permute of the grid written by hand for each axis gives, every group with the timeout."""
    grid, rows = todays_groups(dp, pp, cp, tp)
    steps = ["step11_context_parallel"] + (["step2_process_group_manager"] if cp == 1 else [])
    for step in steps:
        axes = ["tp", "pp", "dp"] + (["cp", "dp_cp"] if step.startswith("step11") else [])
        orders = set()  # the order of creation, one per rank
        for rank in range(grid.numel()):
            pgm, fake = built_by_names(step, rank, dp, pp, cp, tp)
            orders.add(str([ranks for ranks, _ in fake.created]))
            where = (grid == rank).nonzero()[0].tolist()
            init = f"{step}: ProcessGroupManager.__init__ of rank {rank} at {(dp, pp, cp, tp)}"
            coords = [pgm.dp_rank, pgm.pp_rank, getattr(pgm, "cp_rank", 0), pgm.tp_rank]
            assert coords == where, f"{init}: its (dp, pp, cp, tp) ranks are {coords}, not {where}"
            assert [pgm.dp_size, pgm.pp_size, getattr(pgm, "cp_size", 1), pgm.tp_size] == [
                dp,
                pp,
                cp,
                tp,
            ], f"{init}: the sizes"
            group = f"{step}: ProcessGroupManager.group of rank {rank} at {(dp, pp, cp, tp)}"
            created = sorted(ranks for ranks, _ in fake.created)
            assert created == sorted(r for axis in axes for r in rows[axis]), (
                f"{group}: dist.new_group made {created}, expected every group of every axis"
            )
            assert all(
                options == {"timeout": timedelta(seconds=7)} for _, options in fake.created
            ), f"{group}: dist.new_group's options were not the manager's timeout"
            for axis in axes:
                mine = next(ranks for ranks in rows[axis] if rank in ranks)
                got = getattr(pgm, f"{axis}_group_ids")
                assert got == mine, f"{init}: {axis}_group_ids is {got}, not {mine}"
                got = fake.created[getattr(pgm, f"{axis}_group")][0]
                assert got == mine, f"{group}: {axis}_group is the group of {got}, not of {mine}"
            if step.startswith("step11"):
                assert pgm.group("cp", "dp") == (pgm.dp_cp_group, pgm.dp_cp_group_ids)
            assert pgm.group("tp") == (pgm.tp_group, pgm.tp_group_ids), (
                f"{group}: a second call for tp gave another group than the first"
            )
            assert len(fake.created) == sum(len(rows[axis]) for axis in axes), (
                f"{group}: dist.new_group made {len(fake.created)} groups, expected each once"
            )
        assert len(orders) == 1, f"{step}: the ranks created the groups in different orders"


def test_an_unknown_axis_is_refused():
    pgm, fake = built_by_names("step11_context_parallel", 0, 2, 1, 2, 1)
    created = len(fake.created)
    for axes in [("ep",), ("dp", "ep"), ()]:
        with pytest.raises(ValueError, match="its axes are dp, pp, cp, tp"):
            pgm.group(*axes)
    assert len(fake.created) == created
