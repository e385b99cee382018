"""Data parallelism: every dp rank holds the whole (tensor-parallel) model and trains on its own
share of each batch; averaging the gradients over the ranks makes the step the same as one
process taking the whole batch.

With gradient accumulation the average must be taken once, of the accumulated gradient, after the
last micro-batch. A hook on the gradient tensor itself (`param.register_hook`) sees only the
gradient of the current micro-batch, before it is added to `param.grad`: averaging there on the
last micro-batch averages that micro-batch alone, leaves the earlier ones local, and the replicas
silently drift apart. `register_post_accumulate_grad_hook` runs after the addition, on the sum.
"""

import torch.distributed as dist
from torch import nn


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
        is nothing left to wait for; a version whose all-reduces run during backward waits here."""
