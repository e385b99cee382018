"""When the gradient buckets' collectives ran, recorded beside the wrapper that launches them:
when, in the backward that synchronises the gradients, the first and the last gradient were ready,
when each bucket's collective was launched and when it finished, and how long the step then waited
for the last ones. `--dp_timeline` prints it and writes it as a Chrome trace (chrome://tracing and
ui.perfetto.dev open it; tools/plot_timeline.py draws it).
"""

import json
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch.distributed as dist

from utils import log


class NoOverlapTimeline:
    """Records nothing: what the bucketed wrapper runs with unless given an `OverlapTimeline`."""

    def watch(self, buckets):
        pass

    def gradient_ready(self):
        pass

    def launch(self, bucket):
        return nullcontext()

    def wait(self):
        return nullcontext()

    def reset(self):
        pass


NO_TIMELINE = NoOverlapTimeline()


class OverlapTimeline(NoOverlapTimeline):
    """The wrapper's record of one step on this rank, in wall-clock nanoseconds. A finish is
    stamped by a thread that waits on the collective (gloo's wait returns when it is done;
    NCCL's when it is queued on the GPU, hence CPU only)."""

    def watch(self, buckets):
        """The wrapper's buckets, in backward's order; each launches under `launch`."""
        if buckets[0].grad_data.is_cuda:
            # NCCL's wait returns when the collective is queued on the GPU, not when it has run.
            raise ValueError(
                "--dp_timeline times gloo's all-reduces on CPU; on CUDA use --profile DIR"
            )
        self.buckets, self.index = buckets, {id(bucket): i for i, bucket in enumerate(buckets)}
        self.collective, self.group = buckets[0].collective, buckets[0].dp_group
        self.sizes = [
            bucket.grad_data.numel() * bucket.grad_data.element_size() for bucket in buckets
        ]
        for bucket in buckets:
            bucket.timeline = self
        self.reset()

    def reset(self):
        self.first = self.last = self.wait_span = None
        self.spans, self.pending = [], []  # (bucket, launched, finished); the waiting threads
        self.launched_in_backward = 0  # buckets whose collective started before backward ended

    def gradient_ready(self):
        self.last = time.time_ns()
        self.first = self.first or self.last

    @contextmanager
    def launch(self, bucket):
        start = time.time_ns()
        yield
        index, handle = self.index[id(bucket)], bucket.handle

        def finished():
            handle.wait()
            self.spans.append((index, start, time.time_ns()))

        # A daemon: should the step fail, a thread still waiting does not keep the process alive.
        self.pending.append(threading.Thread(target=finished, daemon=True))
        self.pending[-1].start()

    @contextmanager
    def wait(self):
        """Around the wrapper's wait for every bucket, after backward."""
        self.launched_in_backward = sum(bucket.handle is not None for bucket in self.buckets)
        start = time.time_ns()
        yield
        end = time.time_ns()
        self.wait_span = (start, end)
        for thread in self.pending:
            thread.join()
        # A thread may wake late on a busy machine; every collective was done when the wait was.
        self.spans = [(index, begin, min(finish, end)) for index, begin, finish in self.spans]

    def summary(self):
        """(ms of backward, ms during which some bucket was communicating, the fraction of that
        time within backward, ms waited after backward)."""
        busy = during = 0
        reach = self.first  # the time up to which communication is already counted
        for _, start, end in sorted(self.spans, key=lambda span: span[1]):
            start = max(start, reach)
            if end > start:
                busy += end - start
                during += max(0, min(end, self.last) - start)
                reach = end
        ms = lambda ns: ns / 1e6
        hidden = during / busy if busy else 1.0
        wait = self.wait_span
        return ms(self.last - self.first), ms(busy), hidden, ms(wait[1] - wait[0])

    def report(self, bucket_size_mb, trace_path=""):
        """How the buckets' collectives overlapped the backward that launched them, on this rank.
        With a trace path, rank 0 also writes the step as a Chrome trace."""
        backward, busy, during, waited = self.summary()
        n = len(self.sizes)
        buckets = f"{n} bucket{'s' if n > 1 else ''} of at most {bucket_size_mb:g} MB"
        figures = (
            f"backward {backward:.1f} ms | {self.collective}s in flight {busy:.1f} ms, "
            f"{during:.0%} of that during backward | waited {waited:.1f} ms after it"
        )
        log(f"dp overlap: {buckets}, {self.launched_in_backward} launched in backward | {figures}")
        if trace_path and dist.get_rank() == 0:
            ranks = dist.get_world_size(self.group)
            title = f"{self.collective} over {ranks} ranks, {buckets}: {figures}"
            trace = {"traceEvents": self.trace_events(), "otherData": {"title": title}}
            Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
            Path(trace_path).write_text(json.dumps(trace))

    def trace_events(self):
        """A Chrome trace: one track for the backward and the wait after it, one per bucket."""
        spans = [(0, "backward (first to last gradient)", "backward", self.first, self.last)]
        spans.append((0, f"waiting for the {self.collective}s", "wait", *self.wait_span))
        for index, start, end in self.spans:
            size = f"{self.sizes[index] / 2**20:.2f} MB"
            spans.append((index + 1, f"{self.collective} {size}", self.collective, start, end))
        origin = min(start for *_, start, _ in spans)
        events = [
            dict(name=name, cat=category, ph="X", ts=(start - origin) // 1000,
                 dur=(end - start) // 1000, pid=0, tid=track)
            for track, name, category, start, end in spans
        ]  # fmt: skip
        names = ["backward"] + [f"bucket {i}" for i in range(len(self.sizes))]
        for track, name in enumerate(names):
            events.append(dict(name="thread_name", ph="M", pid=0, tid=track, args={"name": name}))
        return events
