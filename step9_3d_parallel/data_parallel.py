"""Data parallelism: every dp rank holds the whole (tensor-parallel) model and trains on its own
share of each batch; averaging the gradients over the ranks makes the step the same as one
process taking the whole batch.

With gradient accumulation the average must be taken once, of the accumulated gradient, after the
last micro-batch. A hook on the gradient tensor itself (`param.register_hook`) sees only the
gradient of the current micro-batch, before it is added to `param.grad`: averaging there on the
last micro-batch averages that micro-batch alone, leaves the earlier ones local, and the replicas
silently drift apart. `register_post_accumulate_grad_hook` runs after the addition, on the sum.

The naive version sends one blocking all-reduce per parameter. The bucketed version groups the
gradients into a few large buffers and sends each asynchronously as soon as it is complete, while
backward goes on: fewer, larger messages, and communication hidden behind computation.
`--dp_timeline` shows it: `OverlapTimeline` records when each bucket's all-reduce ran.
"""

import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from utils import log


class DataParallelNaive(nn.Module):
    """All-reduce (average) each parameter's accumulated gradient over the data-parallel group as
    soon as backward has produced it, on the last micro-batch of a step only."""

    def __init__(self, module, dp_group):
        super().__init__()
        self.module, self.dp_group = module, dp_group
        self.dp_size = dist.get_world_size(dp_group)
        # Set by the training loop: False on the accumulation micro-batches, True on the last.
        self.require_backward_grad_sync = True
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_reduce_grad(self, param):
        if self.require_backward_grad_sync and self.dp_size > 1:
            param.grad /= self.dp_size
            dist.all_reduce(param.grad, group=self.dp_group)  # blocks until every rank has it

    def finish_gradient_synchronization(self):
        """Called after the last backward. Each all-reduce above blocked until done, so here there
        is nothing left to wait for; the bucketed version of step 6 waits here."""


class Bucket:
    """Parameters whose gradients live side by side in one flat fp32 buffer and are all-reduced
    together, by one asynchronous call, as soon as the last of them has its gradient."""

    collective = "all-reduce"

    def __init__(self, params, grad_data, dp_group):
        self.params, self.grad_data, self.dp_group = set(params), grad_data, dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.ready, self.handle = set(), None
        self.timeline = None  # an OverlapTimeline, with --dp_timeline

    def mark_ready(self, param):
        self.ready.add(param)
        if len(self.ready) == len(self.params):
            self.launch()

    def launch(self):
        start = time.time_ns()
        self.sync_gradient()
        if self.timeline is not None:
            self.timeline.launched(self, start)

    def sync_gradient(self):
        """Start the all-reduce and return at once: backward goes on computing other buckets'
        gradients while this one travels."""
        assert self.handle is None
        self.grad_data /= self.dp_size
        self.handle = dist.all_reduce(self.grad_data, group=self.dp_group, async_op=True)

    def wait(self):
        if self.handle is None:  # some parameter got no gradient: send what there is now
            self.launch()
        self.handle.wait()

    def reset(self):
        self.ready, self.handle = set(), None
        self.grad_data.zero_()


class BucketManager:
    """Lays the gradients out in buckets of about `bucket_size` bytes, in the order in which
    backward produces them (the reverse of the order of the parameters), and gives each
    parameter a `main_grad`: its view into its bucket's buffer."""

    def __init__(self, params, dp_group, bucket_size, grad_dtype=torch.float32):
        element_size = torch.empty((), dtype=grad_dtype).element_size()
        groups, size = [[]], 0
        for param in reversed(params):
            if groups[-1] and size + param.numel() * element_size > bucket_size:
                groups, size = [*groups, []], 0
            groups[-1].append(param)
            size += param.numel() * element_size
        self.buckets, self.bucket_of = [], {}
        for group in groups:
            numel = sum(p.numel() for p in group)
            grad_data = torch.zeros(numel, dtype=grad_dtype, device=group[0].device)
            offset = 0
            for param in group:
                param.main_grad = grad_data[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                self.bucket_of[param] = len(self.buckets)
            self.buckets.append(Bucket(group, grad_data, dp_group))

    def mark_ready(self, param):
        self.buckets[self.bucket_of[param]].mark_ready(param)

    def wait(self):
        # Buckets no hook launched (a parameter without gradient) are launched here, in a fixed
        # order; the others were launched by backward, in the same order on every rank.
        for bucket in self.buckets:
            bucket.wait()

    def reset(self):
        for bucket in self.buckets:
            bucket.reset()


class DataParallelBucket(nn.Module):
    """Data parallelism with gradient buckets: backward accumulates each gradient into its fp32
    bucket, and on the last micro-batch a full bucket starts its all-reduce at once, so the
    communication of late layers overlaps the backward of early ones."""

    def __init__(self, module, dp_group, bucket_size_mb=25, timeline=False):
        super().__init__()
        self.module, self.dp_group = module, dp_group
        self.require_backward_grad_sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        self.bucket_manager = BucketManager(params, dp_group, int(bucket_size_mb * 2**20))
        self.launched_in_backward = 0  # buckets whose all-reduce started before backward ended
        self.timeline = OverlapTimeline(self.bucket_manager.buckets) if timeline else None
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulate_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _accumulate_grad(self, param):
        # Move this micro-batch's gradient into the fp32 buffer; autograd starts afresh next time.
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.require_backward_grad_sync:
            if self.timeline is not None:
                self.timeline.gradient_ready()
            self.bucket_manager.mark_ready(param)

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce, then hand the averaged gradients to the optimizer."""
        self.launched_in_backward = sum(b.handle is not None for b in self.bucket_manager.buckets)
        start = time.time_ns()
        self.bucket_manager.wait()
        if self.timeline is not None:
            self.timeline.waited(start, time.time_ns())
        for param in self.bucket_manager.bucket_of:
            same_dtype = param.main_grad.dtype == param.dtype
            param.grad = param.main_grad if same_dtype else param.main_grad.to(param.dtype)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        self.bucket_manager.reset()
        if self.timeline is not None:
            self.timeline.reset()

    def report_overlap(self, bucket_size_mb, trace_path=""):
        """With --dp_timeline: how the buckets' collectives overlapped the backward that launched
        them, on this rank. With a trace path, rank 0 also writes the step as a Chrome trace
        (chrome://tracing and ui.perfetto.dev open it; tools/plot_timeline.py draws it)."""
        timeline = self.timeline
        backward, busy, during, waited = timeline.summary()
        n = len(timeline.sizes)
        buckets = f"{n} bucket{'s' if n > 1 else ''} of at most {bucket_size_mb:g} MB"
        figures = (
            f"backward {backward:.1f} ms | {timeline.collective}s in flight {busy:.1f} ms, "
            f"{during:.0%} of that during backward | waited {waited:.1f} ms after it"
        )
        log(f"dp overlap: {buckets}, {self.launched_in_backward} launched in backward | {figures}")
        if trace_path and dist.get_rank() == 0:
            ranks = dist.get_world_size(self.dp_group)
            title = f"{timeline.collective} over {ranks} ranks, {buckets}: {figures}"
            trace = {"traceEvents": timeline.trace_events(), "otherData": {"title": title}}
            Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
            Path(trace_path).write_text(json.dumps(trace))


### begin Overlap timeline
class OverlapTimeline:
    """When, in the backward that synchronises the gradients, the first and the last gradient were
    ready, when each bucket's all-reduce was launched and when it finished, and how long the step
    then waited for the last ones: what `--dp_timeline` writes. Wall-clock nanoseconds; a finish
    is stamped by a thread that waits on the collective (gloo's wait returns when it is done;
    NCCL's when it is queued on the GPU, hence CPU only)."""

    def __init__(self, buckets):
        if buckets[0].grad_data.is_cuda:
            # NCCL's wait returns when the collective is queued on the GPU, not when it has run.
            raise ValueError(
                "--dp_timeline times gloo's all-reduces on CPU; on CUDA use --profile DIR"
            )
        self.index = {id(bucket): i for i, bucket in enumerate(buckets)}
        self.collective = buckets[0].collective
        self.sizes = [
            bucket.grad_data.numel() * bucket.grad_data.element_size() for bucket in buckets
        ]
        for bucket in buckets:
            bucket.timeline = self
        self.reset()

    def reset(self):
        self.first = self.last = self.wait = None
        self.spans, self.pending = [], []  # (bucket, launched, finished); the waiting threads

    def gradient_ready(self):
        self.last = time.time_ns()
        self.first = self.first or self.last

    def launched(self, bucket, start):
        index, handle = self.index[id(bucket)], bucket.handle

        def finished():
            handle.wait()
            self.spans.append((index, start, time.time_ns()))

        # A daemon: should the step fail, a thread still waiting does not keep the process alive.
        self.pending.append(threading.Thread(target=finished, daemon=True))
        self.pending[-1].start()

    def waited(self, start, end):
        self.wait = (start, end)
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
        return ms(self.last - self.first), ms(busy), hidden, ms(self.wait[1] - self.wait[0])

    def trace_events(self):
        """A Chrome trace: one track for the backward and the wait after it, one per bucket."""
        spans = [(0, "backward (first to last gradient)", "backward", self.first, self.last)]
        spans.append((0, f"waiting for the {self.collective}s", "wait", *self.wait))
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


### end Overlap timeline
