"""Sequence parallelism (Megatron-LM, "Reducing Activation Recomputation in Large Transformer
Models"): between the tensor-parallel regions, each tp rank holds only its part of the sequence.

Under plain tensor parallelism, attention and the MLP are split over the tp ranks, but what lies
between them is not: the residual stream, the two RMSNorms of each block, and what autograd saves
at them are whole, (B, T, D), on every tp rank. Those work token by token, so each tp rank can run
them on its own T/tp tokens, and keep a tp-th of their activations. The two places where a
whole tensor was needed change:

- f, where a norm's output enters the column-parallel layers (q/k/v, gate/up, lm_head): instead
  of the identity, an all-gather along the sequence, (B, T/tp, D) -> (B, T, D); backward, a
  reduce-scatter of the input gradient (its sum over the ranks, each keeping its tokens);
- g, after the row-parallel layers (o_proj, down_proj) and the embedding: instead of the
  all-reduce of the partial sums, a reduce-scatter along the sequence, (B, T, D) -> (B, T/tp, D);
  backward, an all-gather.

An all-reduce is a reduce-scatter followed by an all-gather, so the ranks send what plain tensor
parallelism sends, cut in two places. One thing more: a norm's weight meets only this rank's
tokens, so its gradient is a partial sum, added up over tp (`Copy` on the weight: identity
forward, all-reduce backward) before anything reads it: the data-parallel reductions, the
gradient norm, the optimizer.

Under context parallelism a cp rank holds T/cp tokens (its two chunks); sequence parallelism cuts
those into tp pieces, so a rank holds T/(cp tp) tokens of the residual stream, and that is what a
pipeline stage sends to the next.
"""

# B batch, T this rank's tokens under plain tensor parallelism, D hidden

from contextlib import contextmanager

import torch
import torch.distributed as dist

from model import RMSNorm
from tensor_parallel import Copy, Reduce, RowParallelLinear, VocabParallelEmbedding


def check_sequence_parallel(parser, args):
    """Refuse, before anything runs, what sequence parallelism cannot cut."""
    if not args.sequence_parallel:
        return
    if args.tp_size < 2:
        parser.error(
            f"--sequence_parallel cuts the sequence over the tp ranks, here --tp_size "
            f"{args.tp_size}: use --tp_size 2 or more, or drop --sequence_parallel"
        )
    ranks = args.tp_size * args.cp_size
    if args.seq_len % ranks:
        parser.error(
            f"--sequence_parallel cuts each sequence of --seq_len {args.seq_len} into tp_size x "
            f"cp_size = {args.tp_size} x {args.cp_size} = {ranks} equal pieces: use a --seq_len "
            f"that {ranks} divides"
        )


def gather_sequence(x, group):
    """The tp ranks' pieces of the sequence side by side: (B, T/tp, D) -> (B, T, D)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.transpose(0, 1).contiguous()  # (T/tp, B, D): each rank's piece is one block of memory
    whole = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(whole, x, group=group)  # (T, B, D)
    return whole.transpose(0, 1).contiguous()  # (B, T, D)


def reduce_scatter_sequence(x, group):
    """The sum over the tp ranks, each keeping its piece of the sequence: (B, T, D) ->
    (B, T/tp, D)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.transpose(0, 1).contiguous()  # (T, B, D): rank r's piece is block r of memory
    mine = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(mine, x, group=group)  # (T/tp, B, D)
    return mine.transpose(0, 1).contiguous()  # (B, T/tp, D)


class GatherSequence(torch.autograd.Function):
    """f under sequence parallelism. Forward: all-gather along the sequence. Backward: each rank's
    input gradient is a partial sum (its heads' or its MLP slice's share) for every token: a
    reduce-scatter sums them and leaves each rank its tokens'."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """g under sequence parallelism. Forward: reduce-scatter the partial sums along the sequence.
    Backward: every rank's partial sum took part in every token: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


def norm_forward(norm, x):
    """The model's RMSNorm on this rank's tokens, its weight's gradient summed over tp: the weight
    goes in through `Copy` (identity forward, all-reduce backward) for this call only."""
    weight = norm._parameters["weight"]  # ZeRO-3 may have put the whole weight here for the call
    norm._parameters["weight"] = Copy.apply(weight, norm.tp_group)
    try:
        return RMSNorm.forward(norm, x)
    finally:
        norm._parameters["weight"] = weight


def set_sequence_parallel(model, on):
    """f and g as sequence parallelism has them (`on`), or as plain tensor parallelism."""
    for module in model.modules():
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
            module.g = ScatterSequence if on else Reduce
        if isinstance(module, RMSNorm):
            module.f = GatherSequence if on else Copy


def apply_sequence_parallel(model):
    """Turn the tensor-parallel model into a sequence-parallel one: f and g along the sequence,
    and the norms' weight gradients summed over tp. Call it after `apply_tensor_parallel`."""
    set_sequence_parallel(model, True)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = norm_forward.__get__(module)
    return model


@contextmanager
def whole_sequence_per_tp_rank(model):
    """Within: every tp rank holds the whole sequence, as under plain tensor parallelism
    (sampling gives every rank the same prompt, of any length); then f and g as they were."""
    was = [(m, name, vars(m)[name]) for m in model.modules() for name in "fg" if name in vars(m)]
    set_sequence_parallel(model, False)
    try:
        yield
    finally:
        for module, name, value in was:
            setattr(module, name, value)
