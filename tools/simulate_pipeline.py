"""What a pipeline schedule does with time, without a model: each rank's timeline, its idle
fraction (the bubble) and the micro-batches it holds, from unit costs of a forward and a backward.

    python tools/simulate_pipeline.py --pp_size 4 --micro_batches 8
    python tools/simulate_pipeline.py --pp_size 4 --micro_batches 8 --engine interleaved \\
        --virtual_stages 2 --forward 1 --backward 2
    python tools/simulate_pipeline.py --pp_size 4 --micro_batches 8 --engine zb1 --weight 1
    python tools/simulate_pipeline.py --pp_size 4 --micro_batches 8 --engine zb1 \\
        --trace runs/zb1_trace.json

The schedules are step 14's own (`pipeline_parallel.SCHEDULES`), the lists of actions the trainer
runs. Each rank runs its actions in order, one at a time; an action starts when the rank is free
and what it needs has arrived: a forward, the previous stage's forward of the same micro-batch
(the stage before is on the previous rank; rank 0's chunk c follows the last rank's chunk c - 1),
a backward, the next stage's backward. Messages take no time. A chunk's forward costs
--forward / v time units and its backward --backward / v: the layers are cut into v times as
many pieces. Where the backward is split (zb1), B costs --backward minus --weight and W
--weight; a W waits for nothing but its own B. Each rank's line shows one character per tick
(a time unit, or a v-th of one when the costs do not divide): a forward's ticks show its
micro-batch's number (1, 2, ..., then A, B, ...), a backward's a letter (a for micro-batch 1, b
for 2, ...), a W's a star, idle ticks a dot; the chunks of interleaved are not told apart. The
bubble is the idle share of the step on a rank; the textbook one, (p - 1) / (v m + p - 1), is
AFAB's and 1F1B's at v = 1; with F, B and W of one unit each, ZB-H1's is (p - 1) / (3 m + p - 1).

`--trace` takes the costs from a `--pp_timeline` trace of a run instead: the medians of its
forwards, backwards and W's (each a chunk's), in units of a quarter of a chunk's forward (the
engine, p, m and v still come from the flags). A trace without W's keeps the share of the
backward that --weight and --backward give it.
"""

import argparse
import json
import statistics
import string
import sys
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = "step14_pipeline_schedules"
DIGITS = string.digits[1:] + string.ascii_uppercase  # F of micro-batch 1, 2, ...
LETTERS = string.ascii_lowercase  # B of micro-batch 1, 2, ...


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default=None, help="afab, 1f1b, interleaved or zb1 (all: none)")
    parser.add_argument("--pp_size", type=int, default=4)
    parser.add_argument("--micro_batches", type=int, default=8, help="m")
    parser.add_argument("--virtual_stages", type=int, default=2, help="v, for interleaved")
    parser.add_argument("--forward", type=int, default=1, help="a stage's forward, time units")
    parser.add_argument("--backward", type=int, default=2, help="a stage's backward")
    parser.add_argument("--weight", type=int, default=1, help="W's share of it, for zb1")
    parser.add_argument("--trace", help="the costs from a --pp_timeline trace (JSON)")
    args = parser.parse_args(argv)
    for name in ["pp_size", "micro_batches", "virtual_stages", "forward", "backward", "weight"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.engine in (None, "zb1") and args.weight >= args.backward:  # only zb1 splits it
        parser.error(
            f"--weight {args.weight} must be less than --backward {args.backward}: W is a part "
            f"of the backward, B the rest"
        )
    if args.engine == "interleaved" and args.micro_batches % args.pp_size:
        parser.error(
            f"interleaved sends micro-batches in groups of pp_size: --micro_batches "
            f"{args.micro_batches} is not a multiple of --pp_size {args.pp_size}"
        )
    args.measured = None
    if args.trace:
        try:
            measured_costs(args)
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--trace {args.trace}: {error}")
    return args


UNITS = 4  # time units in a chunk's forward, when the costs come from a trace


def measured_costs(args):
    """Set --forward, --backward and --weight from the trace's median spans (microseconds)."""
    events = json.loads(Path(args.trace).read_text())["traceEvents"]
    spans = {"forward": [], "backward": [], "weight gradients": []}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in spans:
            spans[event["cat"]].append(event["dur"])
    if not spans["forward"] or not spans["backward"]:
        raise ValueError("no forward or backward spans: not a --pp_timeline trace")
    f, b = statistics.median(spans["forward"]), statistics.median(spans["backward"])
    w = statistics.median(spans["weight gradients"]) if spans["weight gradients"] else None
    v = args.virtual_stages if args.engine == "interleaved" else 1
    unit = Fraction(f) / (UNITS * v) if f else Fraction(1)  # a stage's forward is v chunks'
    backward = b + (w or 0)
    args.forward = UNITS * v
    args.backward = max(2, round(backward / unit))
    share = Fraction(w) / Fraction(backward) if w else Fraction(args.weight, args.backward)
    args.weight = min(max(1, round(args.backward * share)), args.backward - 1)
    counts = ", ".join(f"{len(found)} {kind}" for kind, found in spans.items())
    args.measured = (
        f"costs from {args.trace} (medians of {counts} spans, a chunk's): forward "
        f"{f / 1000:.1f} ms, backward {b / 1000:.1f} ms"
        + (f", W {w / 1000:.1f} ms" if w is not None else "")
        + f"; in units of {float(unit) / 1000:.2f} ms: a stage's forward {args.forward}, "
        f"backward {args.backward} (W {args.weight})"
    )


def schedules():
    sys.path.insert(0, str(ROOT / STEP))
    try:
        import pipeline_parallel
    finally:
        sys.path.remove(str(ROOT / STEP))
    return pipeline_parallel.SCHEDULES, pipeline_parallel.held


def simulate(actions, p, chunks, forward, backward, weight=0):
    """Start and end of every action of every rank: {(rank, action): (start, end)}, in exact
    fractions of a time unit. `actions`: each rank's list, as the schedules give them; `weight`:
    W's cost, taken from B's, where the schedule has W's."""
    split = any(a.kind == "W" for row in actions for a in row)
    weight = weight if split else 0
    cost = {"F": Fraction(forward, chunks), "B": Fraction(backward - weight, chunks)}
    cost["W"] = Fraction(weight, chunks)
    last = chunks * p - 1  # the last stage's index

    def needs(rank, action):  # the action of another rank that this one waits for
        stage = action.chunk * p + rank
        if action.kind == "F" and stage > 0:
            before = stage - 1
            return before % p, type(action)("F", action.micro_batch, before // p)
        if action.kind == "B" and stage < last:
            after = stage + 1
            return after % p, type(action)("B", action.micro_batch, after // p)
        return None

    done, free, position = {}, [Fraction(0)] * p, [0] * p
    while any(position[r] < len(actions[r]) for r in range(p)):
        progress = False
        for r in range(p):
            if position[r] == len(actions[r]):
                continue
            action = actions[r][position[r]]
            need = needs(r, action)
            if need is not None and need not in done:
                continue
            start = max(free[r], done[need][1] if need else Fraction(0))
            if action.kind == "B":  # its own forward, on this rank, came first
                start = max(start, done[r, type(action)("F", *action[1:])][1])
            done[r, action] = (start, start + cost[action.kind])
            free[r], position[r], progress = start + cost[action.kind], position[r] + 1, True
        assert progress, "the schedule waits for itself: a deadlock"
    return done


def timeline(done, actions, p, tick):
    """One line per rank, a character per tick."""
    end = max(e for _, e in done.values())
    lines = []
    for r in range(p):
        row = ["."] * int(end / tick)
        for action in actions[r]:
            start, stop = done[r, action]
            mark = (DIGITS if action.kind == "F" else LETTERS)[action.micro_batch % len(LETTERS)]
            mark = "*" if action.kind == "W" else mark
            for t in range(int(start / tick), int(stop / tick)):
                row[t] = mark
        lines.append(f"  rank {r}  {''.join(row)}")
    return lines


def report(name, args):
    table, held = schedules()
    v = args.virtual_stages if name == "interleaved" else 1
    p, m = args.pp_size, args.micro_batches
    actions = table[name](p, m, v)
    done = simulate([list(a) for a in actions], p, v, args.forward, args.backward, args.weight)
    end = max(e for _, e in done.values())
    work = m * (args.forward + args.backward)  # one rank's compute, every chunk
    bubble = 1 - Fraction(work) / end
    costs = (args.forward, args.backward, args.weight)
    tick = Fraction(1, v) if any(cost % v for cost in costs) else Fraction(1)
    chunks = f", v {v}" if v > 1 else ""
    if name == "zb1":  # with F, B and W of one unit each
        formula, textbook = "(p - 1) / (3 m + p - 1)", Fraction(p - 1, 3 * m + p - 1)
    else:
        formula, textbook = "(p - 1) / (v m + p - 1)", Fraction(p - 1, v * m + p - 1)
    lines = [
        f"{name.upper()}, pp {p}, m {m}{chunks}: step {float(end):g} units, bubble "
        f"{float(bubble):.3f} (textbook {formula} = {float(textbook):.3f}), held "
        f"{', '.join(str(held(a)) for a in actions)} (chunk forwards, rank 0 first)",
        *timeline(done, actions, p, tick),
    ]
    return "\n".join(lines), bubble


def main(argv=None):
    args = parse_args(argv)
    if args.measured:
        print(args.measured)
    engines = [args.engine] if args.engine else ["afab", "1f1b"]
    if not args.engine and args.micro_batches % args.pp_size == 0:
        engines.append("interleaved")
    if not args.engine:
        engines.append("zb1")
    for name in engines:
        print(report(name, args)[0])


if __name__ == "__main__":
    main()
