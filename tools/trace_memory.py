"""The most memory a run held at once, from the traces of `--profile DIR` (step 3 on).

    python tools/trace_memory.py runs/profile            # every trace in the folder
    python tools/trace_memory.py runs/a runs/b           # several runs side by side

The profiler records every allocation and free of the steps it traces (steps 3 to 5), each with
the bytes then allocated on its device since recording began ("Total Allocated"). The peak of
that count is the most a rank held at once during those steps beyond what it held when recording
began (its weights, gradients and optimizer state, allocated before): the activations saved for
backward, the weights a layout gathers, the buffers in flight. One line per trace file (a rank),
in bytes, CPU and each GPU apart.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path


def traces(paths):
    """Every trace file named, or found in the folders named, in order."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(path.glob("*.pt.trace.json*"))
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder")
    if not found:
        raise ValueError(f"no trace (*.pt.trace.json) in {', '.join(paths)}: run with --profile")
    return found


def peaks(path):
    """{device: the largest "Total Allocated" of the trace's memory events}."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    most = {}
    for event in events:
        if event.get("name") == "[memory]":
            args = event["args"]
            device = "cpu" if args["Device Type"] == 0 else f"gpu {args['Device Id']}"
            most[device] = max(most.get(device, 0), args["Total Allocated"])
    if not most:
        raise ValueError(f"{path} holds no memory events: record it with profile_memory (step 3's)")
    return most


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="trace files, or folders of them (--profile DIR)")
    args = parser.parse_args(argv)
    try:
        for path in traces(args.paths):
            held = ", ".join(f"{device} {b:,}" for device, b in sorted(peaks(path).items()))
            print(f"{path}: most held at once beyond the start, bytes: {held}")
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
