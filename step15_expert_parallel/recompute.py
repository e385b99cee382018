"""Activation recomputation: keep less for backward, and compute it again when backward needs it.

Autograd saves, in each layer's forward, the tensors its backward will read: the inputs of every
matmul, the norms' inputs, attention's q, k, v, output and log-sum-exp, the MLP's gate and up
outputs. For a whole batch of long sequences these, not the weights, are what fills a device.

- full: each decoder layer keeps only its input; backward runs the layer's forward again (with
  its communication: tensor parallelism's f and g, context parallelism's ring), then its backward.
  About one more forward per step, a third more compute.
- selective (Megatron-LM's): only attention's kernel is run again, from q, k, v, which are kept.
  The paper drops the score-sized tensors, softmax(QK^T) and its dropout mask, (B, H, T, T)
  each: cheap to compute again, the largest to keep. SDPA's unfused (math) kernel keeps them; a
  fused one (flash or memory-efficient, this model's on CPU and CUDA) never stores them, and
  keeps its output, which o_proj keeps anyway as its input, and the log-sum-exp, (B, H, T): all
  that selective recomputation drops then (tools/activation_memory.py measures both).

Either way the values computed again are the ones computed first (no layer draws random numbers,
and torch's checkpoint restores the random state anyway), so training is exactly the same.

The recomputation goes around the layer's call, not into the model's tree of modules: a wrapper
module would rename the parameters, and their names give the initial weights and the checkpoint.
"""

from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

MODES = ["none", "selective", "full"]


def check_recompute(parser, args):
    """Refuse, before anything runs, a --recompute that this layout cannot use."""
    if args.recompute == "selective" and args.cp_size > 1:
        parser.error(
            "--recompute selective runs the model's attention kernel again; with --cp_size "
            f"{args.cp_size} attention is the ring's, which keeps only q, k, v, the output and "
            "the log-sum-exp already: use --recompute full or none"
        )


def recompute(function, *args):
    """`function(*args)`, keeping only `args` for backward, which runs it again first."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


class RecomputeAttention(TorchFunctionMode):
    """Within: every call of F.scaled_dot_product_attention keeps only q, k, v for backward."""

    def __torch_function__(self, function, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if function is F.scaled_dot_product_attention:
            run = partial(function, **kwargs)  # is_causal, enable_gqa
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
        return function(*args, **kwargs)


def selective(forward, x):
    with RecomputeAttention():
        return forward(x)


def apply_recompute(model, mode):
    """Recompute in each of this stage's decoder layers what `mode` says. The layer's own forward
    is wrapped, inside its call: hooks around the call (ZeRO-3's gather and free) run once."""
    if mode == "none":
        return model
    for layer in model.model.layers.values():
        forward = layer.forward  # the layer's own
        if mode == "full":
            layer.forward = partial(recompute, forward)
        else:
            layer.forward = partial(selective, forward)
    return model
