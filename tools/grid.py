"""A picture of the process grid: which global rank sits where, and the tp, cp, pp and dp groups.

    python tools/grid.py --dp 2 --pp 2 --tp 2
    python tools/grid.py --dp 2 --pp 2 --cp 2 --tp 2

The ranks come from `grid()` of step 11's process_group_manager.py, the function every
ProcessGroupManager lays its ranks out with, and the groups from its `group_ranks()`, the rows the
manager creates its groups from: the picture cannot drift from the code.
`tests/test_foundation_tools.py` checks it against the groups of real ranks.
"""

import argparse
import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AXES = ["dp", "pp", "cp", "tp"]  # the grid's dimensions, tp fastest
ROLE = {
    "tp": "split every weight matrix; all-reduce activations in each layer",
    "cp": "split every sequence; pass key/value blocks around a ring",
    "pp": "hold consecutive stages; send activations forward, gradients back",
    "dp": "hold the same weights; average gradients once a step",
    "dp_cp": "step 11: the same weights; average gradients, shard AdamW over them",
}
MAX_DRAWN = 256  # ranks; beyond, only the groups are listed


def load_grid_module():
    """Step 11's process_group_manager.py, under a name of its own (no step's module clobbered)."""
    path = ROOT / "step11_context_parallel" / "process_group_manager.py"
    spec = importlib.util.spec_from_file_location("step11_process_group_manager", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layout(dp, pp, cp, tp):
    """The (dp, pp, cp, tp) grid of global ranks, and every rank's groups: {axis: [[ranks]]},
    each group the ranks that share the other coordinates, from the manager's `group_ranks`."""
    pgm = load_grid_module()
    assert pgm.AXES == AXES, pgm.AXES
    world = dp * pp * cp * tp
    pgm.check_sizes(world, tp, pp, dp, cp)
    grid = pgm.grid(world, tp, pp, dp, cp)  # (dp, pp, cp, tp)
    groups = {axis: pgm.group_ranks(grid, axis).tolist() for axis in AXES}
    groups["dp_cp"] = pgm.group_ranks(grid, "dp", "cp").tolist()
    return grid, {axis: sorted(g) for axis, g in groups.items()}


def coordinates(grid, rank):
    return dict(zip(AXES, (grid == rank).nonzero()[0].tolist(), strict=True))


def picture(grid):
    """Boxes side by side for the pipeline stages, one block of rows per dp rank; in a box, a
    row per cp rank and a column per tp rank."""
    dp, pp, cp, tp = grid.shape
    width = len(str(grid.numel() - 1))
    label = (5 if dp > 1 else 0) + (5 if cp > 1 else 0)
    inner = tp * (width + 1) + 1
    gap = " ──▶ " if pp > 1 else ""
    blank = " " * len(gap)

    def boxes(left, fill, right, between):
        return " " * label + between.join(left + fill * inner + right for _ in range(pp))

    stage = lambda p: f"pp {p}".center(inner + 2)
    lines = [" " * label + blank.join(stage(p) for p in range(pp))] if pp > 1 else []
    for d in range(dp):
        lines.append(boxes("┌", "─", "┐", blank))
        for c in range(cp):
            name = (f"dp {d}" if dp > 1 and c == 0 else "    ") if dp > 1 else ""
            name += f" cp {c}" if cp > 1 else ""
            cells = [
                "│" + "".join(f" {r:>{width}}" for r in grid[d, p, c].tolist()) + " │"
                for p in range(pp)
            ]
            lines.append(name.ljust(label) + gap.join(cells))
        lines.append(boxes("└", "─", "┘", blank))
    if tp > 1:
        ticks = "".join(f" {t:>{width}}" for t in range(tp))
        lines.append(" " * label + " " + ticks + "   <- tp rank")
    return "\n".join(line.rstrip() for line in lines)


def describe(dp, pp, cp, tp):
    grid, groups = layout(dp, pp, cp, tp)
    world = grid.numel()
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    lines = [
        f"world {world} = dp {dp} x pp {pp} x cp {cp} x tp {tp}",
        "global rank = ((dp_rank * pp_size + pp_rank) * cp_size + cp_rank) * tp_size + tp_rank",
        "",
    ]
    if world <= MAX_DRAWN:
        lines.append(picture(grid))
        caption = "A box: one pipeline stage of one replica; a row in a box: a tp group"
        if cp > 1:
            caption += "; a column in a box: a cp group"
        if pp > 1:
            caption += "; ──▶: the activations each rank sends to the same place in the next stage"
        lines += [*textwrap.wrap(caption + ".", 96), ""]
    alone = [axis for axis in AXES if sizes[axis] == 1]
    for axis in ["tp", "cp", "pp", "dp", "dp_cp"]:
        if axis in alone or (axis == "dp_cp" and (cp == 1 or dp == 1)):
            continue  # a group of one, or the same as the dp (cp) groups
        size = dp * cp if axis == "dp_cp" else sizes[axis]
        # Lines break between groups only: inside one, a no-break space until wrapped.
        listed = " ".join(str(g).replace(" ", "\xa0") for g in groups[axis])
        lines.append(f"{axis} groups, {size} ranks each ({ROLE[axis]}):")
        wrapped = textwrap.wrap(listed, 98, initial_indent="  ", subsequent_indent="  ")
        lines += [line.replace("\xa0", " ") for line in wrapped]
    if alone:
        lines.append(f"{', '.join(f'{a} 1' for a in alone)}: every rank is a group of its own.")
    if world <= MAX_DRAWN:
        lines.append("")
        for rank in range(world):
            where = coordinates(grid, rank)
            mine = {axis: next(g for g in groups[axis] if rank in g) for axis in groups}
            lines.append(
                f"rank {rank}: "
                + " ".join(f"{a} {where[a]}/{sizes[a]}" for a in AXES)
                + " | "
                + " ".join(f"{a} {mine[a]}" for a in ["tp", "cp", "pp", "dp"])
            )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis in ["dp", "pp", "cp", "tp"]:
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis}_size")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        print(describe(args.dp, args.pp, args.cp, args.tp))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
