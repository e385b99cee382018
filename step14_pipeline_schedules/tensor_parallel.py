"""Tensor parallelism (Megatron-LM style): every weight matrix split across the tp ranks.

In a block, q/k/v (and gate/up) are split by output features ("column parallel"): each rank
computes its own heads (its own slice of the MLP width) from the full input, a local matmul.
o_proj (and down_proj) are split by input features ("row parallel"): each rank multiplies its
slice and one all-reduce, g (`Reduce`), sums the partial results. Backward mirrors it: the
gradient of the sublayer's input is a partial sum on each rank (its heads' share), and one
all-reduce, f (`Copy`), sums it where the replicated input enters the sublayer: once for q/k/v,
once for gate/up. So a block costs two all-reduces of (B, T, D) forward and two backward. The
embedding and lm_head are split over the vocabulary (lm_head's input has its own f), and the loss
is computed on the vocabulary shards without gathering the logits.
"""

# B batch, T tokens, D hidden, V vocab, F output features; "/tp": the slice one rank holds

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from placement import Split, init_piece, place


def all_reduce(x, group, op=dist.ReduceOp.SUM):
    """In place over `group`. A group of one rank (tp_size 1) has nothing to add: no call at all,
    which on a GPU is one kernel launch and one wait fewer per sublayer."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class Copy(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient (the input fed every rank's slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class Reduce(torch.autograd.Function):
    """Forward: all-reduce (sum the ranks' partial results). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Gather(torch.autograd.Function):
    """Forward: all-gather the slices along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if dist.get_world_size(group) == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by rows (output features): the output stays split, (.., F/tp).

    A local matmul: its input gradient is this rank's part only. The input must come through f
    (`Copy`), once for all the column-parallel layers that read it (`apply_tensor_parallel`)."""

    def __init__(self, in_features, out_features, group):
        super().__init__()
        self.group, self.tp_rank = group, dist.get_rank(group)
        self.tp_size = dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features))
        place(self, "weight", Split("tp", 0, self.tp_rank, self.tp_size))  # rows

    init_parameter = init_piece  # this rank's piece of the full weight
    linear = staticmethod(F.linear)  # a zero-bubble schedule swaps in one that defers W

    def forward(self, x):
        return self.linear(x, self.weight)  # (.., D) -> (.., F/tp)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by columns (input features): the input comes split, (.., D/tp),
    each rank's product is a partial sum, and one all-reduce adds them up."""

    def __init__(self, in_features, out_features, group):
        super().__init__()
        self.group, self.tp_rank = group, dist.get_rank(group)
        self.tp_size = dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size))
        place(self, "weight", Split("tp", 1, self.tp_rank, self.tp_size))  # columns

    init_parameter = init_piece  # this rank's piece of the full weight
    g = Reduce  # sequence parallelism swaps in a reduce-scatter along the sequence
    linear = staticmethod(F.linear)  # a zero-bubble schedule swaps in one that defers W

    def forward(self, x):
        return self.g.apply(self.linear(x, self.weight), self.group)  # (.., D/tp) -> (.., F)


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows (token ids): each rank looks up the ids it holds, writes
    zeros for the others, and an all-reduce assembles the full embeddings."""

    def __init__(self, num_embeddings, embedding_dim, group, padding_idx=None):
        super().__init__()
        self.group, self.tp_rank = group, dist.get_rank(group)
        self.tp_size = dist.get_world_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_per_partition = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.vocab_per_partition
        self.weight = nn.Parameter(torch.empty(self.vocab_per_partition, embedding_dim))
        place(self, "weight", Split("tp", 0, self.tp_rank, self.tp_size))  # rows: token ids
        # The pad token's row (nn.Embedding's padding_idx) gets no gradient, on the rank holding it.
        local_pad = -1 if padding_idx is None else padding_idx - self.vocab_start
        self.padding_idx = local_pad if 0 <= local_pad < self.vocab_per_partition else None

    init_parameter = init_piece  # this rank's piece of the full weight
    g = Reduce  # sequence parallelism swaps in a reduce-scatter along the sequence
    lookup = staticmethod(F.embedding)  # a zero-bubble schedule swaps in one that defers W

    def forward(self, input_ids):
        # An id that no rank holds would become a zero vector and train on, silently. The data is
        # checked against the vocabulary before the first step, so this is an invariant, asserted
        # on the device: a check on the host would wait for the GPU at every forward.
        inside = (input_ids >= 0) & (input_ids < self.num_embeddings)
        torch._assert_async(inside.all(), "a token id outside the model's vocabulary")
        local = input_ids - self.vocab_start  # (B, T)
        elsewhere = (local < 0) | (local >= self.vocab_per_partition)
        x = self.lookup(local.masked_fill(elsewhere, 0), self.weight, self.padding_idx)  # (B, T, D)
        return self.g.apply(x.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


def vocab_parallel_cross_entropy(logits, targets, group):
    """Mean cross-entropy of logits split over the vocabulary, (B, T, V/tp), never gathered.

    loss = log(sum_v exp(z_v - m)) - (z_target - m), with m the max over the whole vocabulary:
    the max, the sum of exponentials and the target's logit are each reduced across the group.
    `Reduce` has an identity backward, so each rank gets the gradient of its own logits.
    """
    logits = logits.float()
    vocab_per_partition = logits.shape[-1]
    vocab_start = dist.get_rank(group) * vocab_per_partition
    # 1. The max over the whole vocabulary keeps exp() from overflowing; it cancels out of the
    #    loss, so it is a constant for autograd.
    top = logits.max(dim=-1, keepdim=True).values.detach()  # (B, T, 1)
    all_reduce(top, group, op=dist.ReduceOp.MAX)
    shifted = logits - top  # (B, T, V/tp)
    # 2. The sum of exponentials over the whole vocabulary.
    sum_exp = Reduce.apply(shifted.exp().sum(dim=-1), group)  # (B, T)
    # 3. The target's logit: held by one rank, the others contribute zero. Picked by a flat
    #    index, whose backward keeps only the index (gather's keeps a copy of `shifted`).
    local = targets - vocab_start
    mine = (local >= 0) & (local < vocab_per_partition)
    index = local.clamp(0, vocab_per_partition - 1).flatten()
    rows = torch.arange(index.numel(), device=index.device) * vocab_per_partition
    picked = shifted.flatten()[rows + index].view(targets.shape)  # (B, T)
    target_logit = Reduce.apply(picked * mine, group)  # (B, T)
    return (sum_exp.log() - target_logit).mean()


def check_tensor_parallel(config, tp_size):
    """Refuse, with the numbers, a model that tp_size ranks cannot split evenly.

    The vocabulary must divide too: padding it would add logits that must be masked out of the loss
    and the samples, a detail that would hide the lesson; every shipped config divides by 2, 4, 8.
    """
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for name, size in sizes.items():
        if size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide {name}={size}")


# What becomes what: the declarative plan, by module name inside each decoder layer.
PLAN = {
    "self_attn.q_proj": ColumnParallelLinear,
    "self_attn.k_proj": ColumnParallelLinear,
    "self_attn.v_proj": ColumnParallelLinear,
    "self_attn.o_proj": RowParallelLinear,
    "mlp.gate_proj": ColumnParallelLinear,
    "mlp.up_proj": ColumnParallelLinear,
    "mlp.down_proj": RowParallelLinear,
}


def apply_tensor_parallel(model, group):
    """Swap the model's layers for their tensor-parallel versions, following PLAN, and put f
    (`Copy`) on every RMSNorm's output. Call it on the meta device, before the weights exist;
    `init_weights` then gives each rank its slices."""
    for layer in model.model.layers:
        for name, parallel_class in PLAN.items():
            parent_name, child_name = name.split(".")
            parent = layer.get_submodule(parent_name)
            dense = getattr(parent, child_name)
            parallel = parallel_class(dense.in_features, dense.out_features, group)
            setattr(parent, child_name, parallel)
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(*embed.weight.shape, group, embed.padding_idx)
    # lm_head is column parallel: each rank computes the logits of its slice of the vocabulary.
    model.lm_head = ColumnParallelLinear(
        model.lm_head.in_features, model.lm_head.out_features, group
    )
    # f where each replicated input enters column-parallel layers: the norm before attention
    # (q/k/v), the norm before the MLP (gate/up) and the final norm (lm_head). A hook on the norm,
    # not on the sublayer, so that it stays whatever module is swapped in for the attention or the
    # MLP, and model.py stays as it is.
    norms = [layer.input_layernorm for layer in model.model.layers]
    norms += [layer.post_attention_layernorm for layer in model.model.layers]
    for norm in [*norms, model.model.norm]:
        # Sequence parallelism swaps f for an all-gather along the sequence.
        norm.f, norm.tp_group = Copy, group
        norm.register_forward_hook(enter_column_parallel)
    model.tie_weights()
    return model


def enter_column_parallel(norm, args, y):
    """f on a norm's output: where its activations enter the column-parallel layers."""
    return norm.f.apply(y, norm.tp_group)
