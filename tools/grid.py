"""A picture of the process grid: which global rank sits where, and the tp, cp, pp and dp groups;
with --ep, the expert layers' second layout of the same ranks too (ep, edp: step 15).

    python tools/grid.py --dp 2 --pp 2 --tp 2
    python tools/grid.py --dp 2 --pp 2 --cp 2 --tp 2
    python tools/grid.py --dp 4 --cp 2 --ep 2

The ranks come from `grid()` of step 15's process_group_manager.py, the function every
ProcessGroupManager lays its ranks out with (for either of its LAYOUTS), and the groups from its
`group_ranks()`, the rows the manager creates its groups from: the picture cannot drift from the
code.
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
    "ep": "experts: hold different ones; trade tokens in an all-to-all",
    "edp": "experts: hold the same ones",
    "edp_cp": "experts: the same ones; average and shard their gradients",
}
MAX_DRAWN = 256  # ranks; beyond, only the groups are listed


def load_grid_module():
    """Step 15's process_group_manager.py, under a name of its own (no step's module clobbered)."""
    path = ROOT / "step15_expert_parallel" / "process_group_manager.py"
    spec = importlib.util.spec_from_file_location("step15_process_group_manager", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layout(dp, pp, cp, tp, ep=1):
    """The (dp, pp, cp, tp) grid of global ranks, and every rank's groups: {axis: [[ranks]]},
    each group the ranks that share the other coordinates, from the manager's `group_ranks`;
    with ep > 1, the expert layout's groups too (ep, edp, edp_cp), from the same functions."""
    pgm = load_grid_module()
    assert pgm.AXES == AXES, pgm.AXES
    world = dp * pp * cp * tp
    pgm.check_sizes(world, tp, pp, dp, cp)
    if ep < 1 or dp % ep:
        raise ValueError(f"--ep {ep} borrows its ranks from dp: it must divide --dp {dp}")
    grid = pgm.grid(world, tp, pp, dp, cp)  # (dp, pp, cp, tp)
    groups = {axis: pgm.group_ranks(grid, axis).tolist() for axis in AXES}
    groups["dp_cp"] = pgm.group_ranks(grid, "dp", "cp").tolist()
    if ep > 1:
        experts = pgm.grid(world, tp, pp, dp, cp, ep, layout=pgm.EXPERT_AXES)
        for axes in [("ep",), ("edp",), ("edp", "cp")]:
            rows = pgm.group_ranks(experts, *axes, layout=pgm.EXPERT_AXES)
            groups["_".join(axes)] = rows.tolist()
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


def describe(dp, pp, cp, tp, ep=1):
    grid, groups = layout(dp, pp, cp, tp, ep)
    world = grid.numel()
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep": ep, "edp": dp // ep}
    lines = [
        f"world {world} = dp {dp} x pp {pp} x cp {cp} x tp {tp}",
        "global rank = ((dp_rank * pp_size + pp_rank) * cp_size + cp_rank) * tp_size + tp_rank",
    ]
    if ep > 1:
        lines += [
            f"experts: dp {dp} = edp {dp // ep} x ep {ep} (EXPERT_AXES: edp, ep, pp, cp, tp): "
            "dp_rank = edp_rank * ep + ep_rank"
        ]
    lines.append("")
    if world <= MAX_DRAWN:
        lines.append(picture(grid))
        caption = "A box: one pipeline stage of one replica; a row in a box: a tp group"
        if cp > 1:
            caption += "; a column in a box: a cp group"
        if pp > 1:
            caption += "; ──▶: the activations each rank sends to the same place in the next stage"
        lines += [*textwrap.wrap(caption + ".", 96), ""]
    alone = [axis for axis in AXES if sizes[axis] == 1]
    experts = ["ep", "edp", "edp_cp"] if ep > 1 else []
    for axis in ["tp", "cp", "pp", "dp", "dp_cp", *experts]:
        pair = axis.endswith("_cp") and (cp == 1 or sizes[axis.split("_")[0]] == 1)
        if axis in alone or pair or (axis == "edp" and dp == ep):
            continue  # a group of one, or the same as the dp (cp) groups
        size = sizes[axis.split("_")[0]] * (cp if axis.endswith("_cp") else 1)
        # Lines break between groups only: inside one, a no-break space until wrapped.
        listed = " ".join(str(g).replace(" ", "\xa0") for g in groups[axis])
        lines.append(f"{axis} groups, {size} ranks each ({ROLE[axis]}):")
        wrapped = textwrap.wrap(listed, 98, initial_indent="  ", subsequent_indent="  ")
        lines += [line.replace("\xa0", " ") for line in wrapped]
    alone += ["edp"] if ep > 1 and dp == ep else []
    if alone:
        lines.append(f"{', '.join(f'{a} 1' for a in alone)}: every rank is a group of its own.")
    if world <= MAX_DRAWN:
        lines.append("")
        for rank in range(world):
            where = coordinates(grid, rank)
            where |= {"ep": where["dp"] % ep, "edp": where["dp"] // ep}
            mine = {axis: next(g for g in groups[axis] if rank in g) for axis in groups}
            shown = [*AXES, *(["ep", "edp"] if ep > 1 else [])]
            lines.append(
                f"rank {rank}: "
                + " ".join(f"{a} {where[a]}/{sizes[a]}" for a in shown)
                + " | "
                + " ".join(f"{a} {mine[a]}" for a in ["tp", "cp", "pp", "dp"])
            )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis in ["dp", "pp", "cp", "tp", "ep"]:
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis}_size")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        print(describe(args.dp, args.pp, args.cp, args.tp, args.ep))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
