"""Draw the Chrome traces that `--pp_timeline` (step 7) and `--dp_timeline` (step 6) write as a
Gantt chart: one row per track (a pipeline stage, or the backward and the buckets' all-reduces),
one bar per span, coloured by kind. Several traces become panels of one picture on a shared time
axis, so that two schedules or two bucket sizes can be compared at a glance.

    python tools/plot_timeline.py runs/afab.json runs/1f1b.json -o docs/pp_timeline.png
    python tools/plot_timeline.py runs/dp_1mb.json runs/dp_8mb.json -o docs/dp_overlap.png

A pipeline trace's title gives each stage's bubble (the fraction of the step it was not computing)
and its peak number of micro-batches in flight (forwards whose backward had not run yet), both
measured from the spans. Needs matplotlib: pip install -e ".[plot]".
"""

import argparse
import json
import sys
from pathlib import Path

COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "send": "#c44e52",
    "receive": "#8c8c8c",
    "other": "#e6e6e6",
    "all-reduce": "#55a868",
    "reduce-scatter": "#55a868",
    "wait": "#8c8c8c",
}
LABELS = {
    "receive": "receive (waiting for the neighbour)",
    "send": "send (held up by a send)",
    "other": "other (the loop, posting messages)",
    "wait": "waiting for the all-reduces",
}
NAMED = {"forward", "backward"}  # bars that carry their name (F1, B1, ...)


def read_trace(path):
    """(track names in order, spans per track, otherData) of a trace in the Chrome format."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable JSON trace ({error})") from error
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no list of traceEvents)")
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError(f"{path}: no complete ('X') spans to draw")
    tracks = sorted({e["tid"] for e in spans})
    rows = {
        tid: sorted((e for e in spans if e["tid"] == tid), key=lambda e: e["ts"]) for tid in tracks
    }
    info = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    return [names.get(tid, f"track {tid}") for tid in tracks], [rows[t] for t in tracks], info


def pipeline_figures(spans):
    """The bubble and the peak in-flight micro-batches of one stage, from its spans."""
    busy = sum(e["dur"] for e in spans if e["cat"] in ("forward", "backward"))
    length = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    in_flight = peak = 0
    for event in spans:
        in_flight += {"forward": 1, "backward": -1}.get(event["cat"], 0)
        peak = max(peak, in_flight)
    return 1.0 - busy / length if length else 0.0, peak


def title(path, names, rows, info):
    if any(e["cat"] == "forward" for row in rows for e in row):
        figures = [pipeline_figures(row) for row in rows]
        p, m = len(rows), info.get("micro_batches")
        head = f"{info.get('engine', Path(path).stem)}, pp {p}" + (f", m = {m}" if m else "")
        bubbles = " ".join(f"{b:.2f}" for b, _ in figures)
        peaks = " ".join(str(k) for _, k in figures)
        textbook = f" (textbook {(p - 1) / (m + p - 1):.2f})" if m else ""
        return f"{head}: bubble per stage {bubbles}{textbook}; peak in flight {peaks}"
    return info.get("title", Path(path).stem)


def draw(paths, out, dpi):
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print('plot_timeline.py needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    traces = [(path, *read_trace(path)) for path in paths]
    heights = [len(names) for _, names, _, _ in traces]
    figure, axes = plt.subplots(
        len(traces), 1, sharex=True, squeeze=False, height_ratios=heights,
        figsize=(10, 0.9 + 0.45 * sum(heights) + 0.5 * len(traces)),
    )  # fmt: skip
    seen = {}
    for ax, (path, names, rows, info) in zip(axes[:, 0], traces, strict=True):
        for y, row in enumerate(rows):
            for event in row:
                start, width = event["ts"] / 1e3, event["dur"] / 1e3  # ms
                colour = COLOURS.get(event["cat"], "#8172b2")
                bar = ax.barh(y, width, left=start, height=0.7, color=colour, edgecolor="white")
                seen.setdefault(LABELS.get(event["cat"], event["cat"]), bar)
                if event["cat"] in NAMED:
                    ax.text(start + width / 2, y, event["name"], ha="center", va="center",
                            fontsize=6, clip_on=True)  # fmt: skip
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title(path, names, rows, info), fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms from the start of the step")
    order = [LABELS.get(kind, kind) for kind in COLOURS]  # the legend in a fixed order
    labels = sorted(seen, key=lambda label: order.index(label) if label in order else len(order))
    handles = [seen[label] for label in labels]
    figure.legend(handles, labels, loc="upper right", fontsize=7, ncols=len(seen))
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=dpi)
    print(f"wrote {out}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="trace JSON files, one panel each")
    parser.add_argument("-o", "--out", default="timeline.png", help="the PNG to write")
    parser.add_argument("--dpi", type=int, default=90)
    args = parser.parse_args(argv)
    try:
        return draw(args.traces, args.out, args.dpi)
    except ValueError as error:
        print(f"plot_timeline.py: error: {error}", file=sys.stderr)
        return 2
    except (KeyError, TypeError) as error:  # a hand-made or truncated trace
        print(f"plot_timeline.py: error: a trace event lacks a field: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
