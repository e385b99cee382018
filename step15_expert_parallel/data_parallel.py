"""Data parallelism: every dp rank holds the whole (tensor-parallel) model and trains on its own
share of each batch; averaging the gradients over the ranks makes the step the same as one
process taking the whole batch.

With gradient accumulation the average must be taken once, of the accumulated gradient, after the
last micro-batch. A hook on the gradient tensor itself (`param.register_hook`) sees only the
gradient of the current micro-batch, before it is added to `param.grad`: averaging there on the
last micro-batch averages that micro-batch alone, leaves the earlier ones local, and the replicas
silently drift apart. `register_post_accumulate_grad_hook` runs after the addition, on the sum.

The naive version sent one blocking all-reduce per parameter. The bucketed version groups the
gradients into a few large buffers and sends each asynchronously as soon as it is complete, while
backward goes on: fewer, larger messages, and communication hidden behind computation.
`--dp_timeline` shows it: an `OverlapTimeline` (overlap_timeline.py) records when each bucket's
all-reduce ran.
"""

import torch
import torch.distributed as dist
from torch import nn

from overlap_timeline import NO_TIMELINE


class NothingToWaitFor:
    def wait(self):
        pass


NOTHING_TO_WAIT_FOR = NothingToWaitFor()


class Bucket:
    """Parameters whose gradients live side by side in one flat fp32 buffer and are all-reduced
    together, by one asynchronous call, as soon as the last of them has its gradient."""

    collective = "all-reduce"
    timeline = NO_TIMELINE  # an OverlapTimeline that watches the buckets sets itself here

    def __init__(self, params, grad_data, dp_group):
        self.params, self.grad_data, self.dp_group = set(params), grad_data, dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.ready, self.handle = set(), None

    def mark_ready(self, param):
        self.ready.add(param)
        if len(self.ready) == len(self.params):
            self.launch()

    def launch(self):
        with self.timeline.launch(self):
            self.sync_gradient()

    def sync_gradient(self):
        """Start the all-reduce and return at once: backward goes on computing other buckets'
        gradients while this one travels."""
        assert self.handle is None
        if self.dp_size == 1:  # one replica: its gradient is the average, nothing to send
            self.handle = NOTHING_TO_WAIT_FOR
            return
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
    communication of late layers overlaps the backward of early ones. `timeline`: what records
    when the buckets' all-reduces ran (an OverlapTimeline, with --dp_timeline); `buckets`: what
    lays the gradients out in buckets, called as BucketManager is."""

    def __init__(self, module, dp_group, bucket_size_mb=25, timeline=NO_TIMELINE, buckets=None):
        super().__init__()
        self.module, self.dp_group, self.timeline = module, dp_group, timeline
        self.require_backward_grad_sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        buckets = buckets or BucketManager
        self.bucket_manager = buckets(params, dp_group, int(bucket_size_mb * 2**20))
        timeline.watch(self.bucket_manager.buckets)
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulate_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _accumulate_grad(self, param):
        # Move this micro-batch's gradient into the fp32 buffer; autograd starts afresh next time.
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.require_backward_grad_sync:
            self.timeline.gradient_ready()
            self.bucket_manager.mark_ready(param)

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce, then hand the averaged gradients to the optimizer."""
        with self.timeline.wait():
            self.bucket_manager.wait()
        for param in self.bucket_manager.bucket_of:
            same_dtype = param.main_grad.dtype == param.dtype
            param.grad = param.main_grad if same_dtype else param.main_grad.to(param.dtype)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        self.bucket_manager.reset()
        self.timeline.reset()
