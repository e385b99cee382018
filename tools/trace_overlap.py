"""How much of a run's all-gathers ran while its ranks computed, from the traces of `--profile DIR`.

    python tools/trace_overlap.py runs/profile          # every trace in the folder, one per rank

gloo runs a collective started with `async_op=True` on a thread of its own, and the profiler
records it there (`gloo:all_gather`), beside the operators of the thread that trains (the one that
runs the matmuls). For each trace the tool sums the all-gathers' time and the part of it during
which the training thread ran an ATen operator: the communication that computation hid. Step 12's
prefetch is what makes that part large; without it each all-gather starts when its unit is
needed, and the training thread waits through it.
"""

import argparse
import json
import sys
from pathlib import Path

from trace_memory import traces

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm"}


def union(spans):
    """Sorted, non-overlapping (start, end) covering `spans`."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def covered(span, spans):
    """The length of `span` that the merged `spans` cover."""
    start, end = span
    return sum(max(0, min(end, e) - max(start, s)) for s, e in spans)


def overlap(path, collective="gloo:all_gather"):
    """(count, total microseconds, microseconds during an operator of the training thread)."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    counts = {}
    for event in events:
        if event.get("name") in MATMULS:
            counts[event["tid"]] = counts.get(event["tid"], 0) + 1
    if not counts:
        raise ValueError(f"{path}: no matmul in the trace, so no training thread to compare with")
    trainer = max(counts, key=counts.get)
    # ATen's operators only: the autograd engine's spans and the hooks inside them also cover a
    # thread that waits, and c10d's spans are the collectives' own calls.
    ops = [e for e in events if e["tid"] == trainer and e.get("name", "").startswith("aten::")]
    busy = union((e["ts"], e["ts"] + e["dur"]) for e in ops)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == collective]
    return len(spans), sum(e - s for s, e in spans), sum(covered(s, busy) for s in spans)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="trace files, or folders of them (--profile DIR)")
    args = parser.parse_args(argv)
    try:
        for path in traces(args.paths):
            count, total, hidden = overlap(path)
            share = f"{100 * hidden / total:.0f} %" if total else "-"
            print(
                f"{path}: {count} all-gathers, {total / 1000:.1f} ms, {hidden / 1000:.1f} ms of it "
                f"while the training thread computed ({share})"
            )
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
