"""What a pipeline stage did during one step, recorded beside the schedule that ran it: the order
of its forwards and backwards (F1 F2 B1 ...), the peak number of micro-batches whose activations
it held, when each ran and, within the rest of the step (the bubble), when it was held up by a
send or waited for a neighbour's tensor. `--pp_timeline` prints it and writes it as a Chrome
trace (chrome://tracing and ui.perfetto.dev open it; tools/plot_timeline.py draws it).
"""

import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch.distributed as dist

from utils import log


class NoTimeline:
    """Records nothing: what the executor runs with unless given a `Timeline`."""

    def run(self, action):
        return nullcontext()

    def blocked(self, kind, active=True):
        return nullcontext()


class Timeline(NoTimeline):
    """The executor's record of one step on one stage: it wraps every action it runs in `run`
    and every wait for a message in `blocked`. `frees`: the kind of action after which a
    micro-batch's activations are gone (its backward, "B", or where the backward is split, its
    weight gradients, "W")."""

    def __init__(self, frees="B"):
        self.timeline, self.in_flight, self.peak_in_flight = [], 0, 0
        self.frees = frees
        # (kind, micro-batch, start, end) in nanoseconds of the wall clock, which every rank of a
        # machine shares, so that the stages' spans line up in one picture.
        self.spans, self.messages, self.start = [], [], time.time_ns()

    @contextmanager
    def run(self, action):
        start = time.time_ns()
        yield
        self.spans.append((action.kind, action.micro_batch, start, time.time_ns()))
        self.timeline.append(str(action))
        self.in_flight += 1 if action.kind == "F" else -1 if action.kind == self.frees else 0
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    @contextmanager
    def blocked(self, kind, active=True):
        """The stage waits on a "send" or a "receive" (when `active`: a stage with no neighbour
        on that side does not)."""
        start = time.time_ns()
        yield
        if active:
            self.messages.append((kind, None, start, time.time_ns()))

    def bubble(self):
        busy = sum(end - start for _, _, start, end in self.spans)
        return 1.0 - busy / (time.time_ns() - self.start)

    def trace_events(self, stage, end):
        """This stage's step as Chrome trace events (microseconds, one track per stage): a span
        per forward, backward, blocking send and receive, and one per gap left between them
        (the loop itself: posting messages, the loss)."""
        events, previous = [], self.start
        spans = sorted([*self.spans, *self.messages], key=lambda span: span[2])
        for kind, k, start, stop in [*spans, ("end", None, end, end)]:
            if start > previous:
                events.append(span("other", "other", previous, start, stage))
            if kind in CATEGORIES:
                name, category = f"{kind}{k + 1}", CATEGORIES[kind]
                events.append(span(name, category, start, stop, stage, micro_batch=k + 1))
            elif kind != "end":
                events.append(span(kind, kind, start, stop, stage))
            previous = max(previous, stop)
        return events

    def report(self, m, engine, pgm, trace_path=""):
        """Each stage's timeline, its peak of held micro-batches and its idle fraction, beside
        the textbook bubble: AFAB's and 1F1B's (p - 1) / (m + p - 1); with the backward split
        and F, B and W of equal length, (p - 1) / (3 m + p - 1), the W's filling two thirds of
        it. With a trace path, rank 0 also writes its pipeline's step as a Chrome trace, one
        track per stage."""
        end, p, r = time.time_ns(), pgm.pp_size, pgm.pp_rank
        textbook = (p - 1) / ((3 if self.frees == "W" else 1) * m + p - 1)
        log(
            f"pp stage {r} {engine}: {' '.join(self.timeline)} | held at most "
            f"{self.peak_in_flight} micro-batches | bubble {self.bubble():.2f} (textbook "
            f"{textbook:.2f})",
            all_ranks=True,
        )
        if trace_path:
            stages = [None] * p
            dist.all_gather_object(stages, self.trace_events(r, end), group=pgm.pp_group)
            if dist.get_rank() == 0:
                info = {"engine": engine, "pp_size": p, "micro_batches": m}
                write_trace(trace_path, stages, info)
                log(f"pp timeline of this step: {trace_path}")


CATEGORIES = {"F": "forward", "B": "backward", "W": "weight gradients"}


def write_trace(path, stages, info):
    """The stages' events as one Chrome trace: a named track per stage, in order, from time 0."""
    events = [event for stage in stages for event in stage]
    origin = min(event["ts"] for event in events)
    for event in events:
        event["ts"] -= origin
    for s in range(len(stages)):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}}
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as file:
        json.dump({"traceEvents": events, "otherData": info}, file)


def span(name, category, start, end, stage, **args):
    """A complete ("X") event of the Chrome trace format: nanoseconds in, whole microseconds
    out, so that spans that touch still touch."""
    start, end = start // 1000, end // 1000
    return dict(
        name=name, cat=category, ph="X", ts=start, dur=end - start, pid=0, tid=stage, args=args
    )
