"""Median step times of training runs, side by side, from their JSON logs (`--log_file`).

    python tools/step_times.py naive='runs/naive_*.jsonl' 25MiB='runs/b25_*.jsonl'

Each side is LABEL=GLOB: the logs of one configuration (several runs of it pool their steps). A
step's time is the tokens it trained over its tokens_per_second; the first step of every log is
left out (warm-up), and so is a step that does not follow the step logged before it (the first
after a resume that went back). The last column is each side's median over the first side's: run
the sides alternately, so that the machine's load falls on all of them.
"""

import argparse
import glob
import json
import statistics
import sys


def step_seconds(path):
    """The seconds of each step of one log that follows the step logged before it."""
    seconds, previous = [], None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number} is not a JSON line ({error})") from error
            if "tokens_per_second" not in record:
                continue  # not a training step's record
            if previous is not None and record["step"] == previous["step"] + 1:
                tokens = record["tokens"] - previous["tokens"]
                seconds.append(tokens / record["tokens_per_second"])
            previous = record
    return seconds


def side(spec):
    label, sep, pattern = spec.partition("=")
    paths = sorted(glob.glob(pattern))
    if not sep or not label:
        raise ValueError(f"{spec!r}: give each side as LABEL=GLOB, e.g. naive='runs/naive_*.jsonl'")
    if not paths:
        raise ValueError(f"{label}: no log matches {pattern!r}")
    seconds = [s for path in paths for s in step_seconds(path)]
    if not seconds:
        raise ValueError(f"{label}: the logs {paths} hold fewer than two consecutive steps")
    return label, len(paths), seconds


def table(sides):
    rows = ["| side | logs | steps | median s | min s | max s | / first |"]
    rows.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    first = statistics.median(sides[0][2])
    for label, logs, seconds in sides:
        median = statistics.median(seconds)
        rows.append(
            f"| {label} | {logs} | {len(seconds)} | {median:.3f} | {min(seconds):.3f} "
            f"| {max(seconds):.3f} | {median / first:.2f} |"
        )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sides", nargs="+", metavar="LABEL=GLOB", help="the logs of one side")
    args = parser.parse_args(argv)
    try:
        sides = [side(spec) for spec in args.sides]
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(table(sides))


if __name__ == "__main__":
    main()
