"""Context parallelism: every sequence split over the cp ranks, attention computed as a ring.

Everything in a decoder layer but attention works token by token, so each cp rank can run it on
its own part of the sequence. Attention needs, for each query, the keys and values of every
earlier token, which live on other ranks. Ring attention passes them around: at each of cp_size
steps a rank attends its queries to the key/value block it holds, sends that block to the next
rank of the ring and receives one from the previous rank, the transfer overlapping the compute.
After cp_size steps every query has met every block, and no rank ever held the whole sequence's
keys, values or scores.

The blocks arrive one by one, so the softmax over all keys is built up online: each block gives
its output (softmax within the block) and the log-sum-exp of its scores, and two partial results
merge exactly by weighting each with exp(its lse - the merged lse), lse = log(e^lse1 + e^lse2).
A fused attention kernel computes each block (`attend`) without ever storing its scores.
Backward passes the blocks around the ring again, each block's gradient from the kernel's
backward given the final output and lse (`attend_backward`); each block's key/value gradients
travel with it and arrive home after the last step.

The causal split: the sequence is cut into 2 * cp_size equal chunks and rank r holds chunks r and
2 * cp_size - 1 - r, one early and one late. With one contiguous piece per rank, rank 0's queries
would see only their own block and the last rank's all of them: rank 0 idles while the last rank
works. With the pairs every rank computes the same number of (query chunk, key chunk) blocks.
"""

# B batch, H query heads, K key/value heads, T this rank's tokens, C tokens of a chunk, d head dim

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

from model import LlamaAttention, apply_rotary, rotary_cos_sin

aten = torch.ops.aten
# The private kernels called below by position: the arguments passed, in order, and how many
# results are read. A private kernel may change between releases, so check_kernels compares these
# with the installed torch's schemas once, before any is called.
KERNELS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        ["query", "key", "value", "dropout_p", "is_causal"],
        2,
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        ["grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"],
        3,
    ),
    "_scaled_dot_product_flash_attention": (["query", "key", "value", "dropout_p", "is_causal"], 2),
    "_scaled_dot_product_efficient_attention": (
        ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"],
        2,
    ),
    "_scaled_dot_product_flash_attention_backward": (
        [
            "grad_out",
            "query",
            "key",
            "value",
            "out",
            "logsumexp",
            "cum_seq_q",
            "cum_seq_k",
            "max_q",
            "max_k",
            "dropout_p",
            "is_causal",
            "philox_seed",
            "philox_offset",
        ],
        3,
    ),  # fmt: skip
    "_scaled_dot_product_efficient_attention_backward": (
        [
            "grad_out_",
            "query",
            "key",
            "value",
            "attn_bias",
            "out",
            "logsumexp",
            "philox_seed",
            "philox_offset",
            "dropout_p",
            "grad_input_mask",
            "is_causal",
        ],
        4,
    ),  # fmt: skip
}


def check_kernels():
    """Refuse a torch whose private attention kernels take other arguments than the calls below
    pass, or return fewer results than they read."""
    for name, (arguments, results) in KERNELS.items():
        try:
            schema = getattr(aten, name).default._schema
        except (AttributeError, RuntimeError):
            schema = None
        got = [argument.name for argument in schema.arguments] if schema else []
        if got[: len(arguments)] != arguments or len(schema.returns) < results:
            raise ValueError(
                f"context parallelism calls aten.{name}({', '.join(arguments)}) and reads "
                f"{results} results, but torch {torch.__version__} "
                f"{f'defines {schema}' if schema else 'has no such kernel'}; use a torch whose "
                f"kernel takes these arguments"
            )


def chunk_ids(cp_rank, cp_size):
    """The chunks of every sequence (of 2 * cp_size) that cp rank r holds, in this order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_sequence(x, cp_rank, cp_size, dim=1):
    """This rank's part of whole sequences (token ids, targets): its two chunks, side by side."""
    if cp_size == 1:
        return x  # the whole sequence, whatever its length
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size)], dim=dim)


def check_context_parallel(seq_len, cp_size):
    if seq_len % (2 * cp_size):
        fits = max(seq_len // (2 * cp_size), 1) * 2 * cp_size
        raise ValueError(
            f"seq_len={seq_len} is not a multiple of 2 * cp_size = {2 * cp_size}: each cp rank "
            f"holds two equal chunks of every sequence; seq_len={fits} would work"
        )


### begin Ring attention
def ring_send_recv(tensors, group):
    """Send `tensors` to the next rank of the ring, receive the same shapes from the previous
    one; returns the receive buffers and the requests to wait for."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    prev_rank = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, next_rank, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev_rank, group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def expand_heads(x, num_heads):
    """Grouped-query attention: each key/value head serves num_heads / K query heads."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)  # (B, K, C, d) -> (B, H, C, d)


def sum_heads(x, num_kv_heads):
    """The gradient of `expand_heads`: each key/value head sums those of its query heads."""
    return x.unflatten(1, (num_kv_heads, -1)).sum(2)  # (B, H, C, d) -> (B, K, C, d)


def attend(q, k, v, causal):
    """One block of attention with a fused kernel: its output (B, H, C, d), softmax within the
    block, and the log-sum-exp of its scores (B, H, C), without storing the (C, C) scores. On the
    diagonal block (`causal`) a query sees no later key. k and v may have fewer heads (GQA)."""
    if q.device.type == "cuda":
        return attend_cuda(q, k, v, causal)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse  # lse: natural log, (B, H, C) laid out as (B, C, H)


def attend_backward(grad_out, q, k, v, out, lse, causal):
    """The block's share of dq, dk and dv, given the output and lse of the *whole* softmax: the
    kernel recomputes P = exp(s - lse), the final softmax's entries of this block, and its delta
    = rowsum(dO * O) from `out`, so the shares of all blocks add up to the whole gradient."""
    if q.device.type == "cuda":
        return attend_backward_cuda(grad_out, q, k, v, out, lse, causal)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal
    )


def cuda_kernel(q, k, v, causal):
    """FlashAttention where it runs (bf16 or fp16, recent GPUs), else the memory-efficient
    kernel (fp32 too); both return the lse."""
    params = SDPAParams(q, k, v, None, 0.0, causal, False)
    if can_use_flash_attention(params):
        return "flash"
    if can_use_efficient_attention(params, True):  # True: the warnings say why not
        return "efficient"
    raise ValueError(f"no fused attention kernel for {q.dtype} queries of shape {tuple(q.shape)}")


def attend_cuda(q, k, v, causal, kernel=None):
    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])  # (B, H, C, d)
    if (kernel or cuda_kernel(q, k, v, causal)) == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., : q.shape[2]]  # its lse is padded to a multiple of 32 queries


def attend_backward_cuda(grad_out, q, k, v, out, lse, causal, kernel=None):
    K, k, v = k.shape[1], expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    no_rng = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: never read
    if (kernel or cuda_kernel(q, k, v, causal)) == "flash":
        grad_q, grad_k, grad_v = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
            causal, no_rng, no_rng,
        )  # fmt: skip
    else:
        padded = torch.nn.functional.pad(lse, (0, -q.shape[2] % 32))  # as the kernel gave it
        grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, padded, no_rng, no_rng, 0.0, [True] * 3 + [False],
            causal,
        )  # fmt: skip
    return grad_q, sum_heads(grad_k, K), sum_heads(grad_v, K)


def merge(out, lse, block_out, block_lse):
    """Two softmax-weighted partial results over disjoint keys, merged: the exact result over
    both. Before the first block lse is -inf and its weight exp(-inf) = 0."""
    new_lse = torch.logaddexp(lse, block_lse)  # (B, H, C)
    out = out * (lse - new_lse).exp().unsqueeze(-1)
    return out + block_out * (block_lse - new_lse).exp().unsqueeze(-1), new_lse


def blocks(cp_rank, source, cp_size):
    """(i, j, causal) for each block this rank computes with `source`'s keys: its i-th query
    chunk against the source's j-th key chunk, skipped when every key is after every query."""
    for i, q_chunk in enumerate(chunk_ids(cp_rank, cp_size)):
        for j, k_chunk in enumerate(chunk_ids(source, cp_size)):
            if k_chunk <= q_chunk:
                yield i, j, k_chunk == q_chunk


def spans(cp_rank, source, cp_size, C):
    """The blocks of `blocks` joined into as few kernel calls as they allow: (queries, keys,
    causal), slices of this rank's T = 2C tokens and of the source's. Against its own keys the
    three blocks are one causal call over both chunks (they are in order, so the causal mask of
    the two together is that of the three); blocks that make a rectangle, one call."""
    found = list(blocks(cp_rank, source, cp_size))
    chunks = lambda first, last: slice(first * C, (last + 1) * C)
    if source == cp_rank:
        assert found == [(0, 0, True), (1, 0, False), (1, 1, True)], found
        yield chunks(0, 1), chunks(0, 1), True
        return
    rows, cols = sorted({i for i, _, _ in found}), sorted({j for _, j, _ in found})
    if found and len(found) == len(rows) * len(cols):
        yield chunks(rows[0], rows[-1]), chunks(cols[0], cols[-1]), False
    else:
        yield from ((chunks(i, i), chunks(j, j), False) for i, j, _ in found)


def without_autocast(function):
    """Run forward or backward with autocast off on the device of its first tensor: the blocks
    run in the dtype of q, k and v, and the merge in fp32, whatever autocast would choose."""

    @functools.wraps(function)
    def run(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return function(ctx, first, *args)

    return run


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (B, H, T, d) over the whole sequence, whose keys
    and values (B, K, T, d) are spread over the cp group, T = 2 chunks per rank (`chunk_ids`).
    Each block runs in the inputs' dtype (fp32 or bf16), the merge in fp32 (fp64 for fp64)."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, group):
        cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
        (B, H, T, d), C = q.shape, q.shape[2] // 2
        exact = torch.promote_types(q.dtype, torch.float32)  # what the merge runs in
        # (B, H, T, d), laid out as (B, T, H, d): o_proj's input is then a view, not a copy.
        out = q.new_zeros(B, T, H, d, dtype=exact).transpose(1, 2)
        lse = q.new_full((B, H, T), -torch.inf, dtype=exact)
        kv = [k.contiguous(), v.contiguous()]  # the block held, from `source`
        for step in range(cp_size):
            source = (cp_rank - step) % cp_size
            if step < cp_size - 1:  # the next block travels while this one is computed
                received, requests = ring_send_recv(kv, group)
            for mine, theirs, causal in spans(cp_rank, source, cp_size, C):
                keys, values = (x[:, :, theirs] for x in kv)
                block_out, block_lse = attend(q[:, :, mine], keys, values, causal)
                block = block_out.to(exact), block_lse.to(exact)
                if step > 0:
                    block = merge(out[:, :, mine], lse[:, :, mine], *block)
                # at step 0 the rank's own keys, seen by all its queries: nothing to merge with yet
                out[:, :, mine], lse[:, :, mine] = block
            if step < cp_size - 1:
                for request in requests:
                    request.wait()
                kv = received
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
        exact, C = lse.dtype, q.shape[2] // 2  # the blocks' shares add up in fp32 (fp64)
        grad_out = grad_out.to(q.dtype)
        grad_q = torch.zeros_like(q, dtype=exact)
        kv = [k.contiguous(), v.contiguous()]
        # The gradient of the block held travels with it, summed over the ranks it has visited:
        # the previous rank's sum arrives while this rank computes its own share.
        grad_kv, grad_requests = None, []
        for step in range(cp_size):
            source = (cp_rank - step) % cp_size
            if step < cp_size - 1:
                received, requests = ring_send_recv(kv, group)
            share = [torch.zeros_like(x, dtype=exact) for x in kv]  # this rank's, (B, K, T, d)
            for mine, theirs, causal in spans(cp_rank, source, cp_size, C):
                dq, dk, dv = attend_backward(
                    grad_out[:, :, mine], q[:, :, mine], *(x[:, :, theirs] for x in kv),
                    out[:, :, mine], lse[:, :, mine], causal,
                )  # fmt: skip
                grad_q[:, :, mine].add_(dq)  # in place (`+=` on a slice would copy it back too)
                share[0][:, :, theirs].add_(dk)
                share[1][:, :, theirs].add_(dv)
            for request in grad_requests:
                request.wait()
            if grad_kv is not None:  # the sum of the ranks before: none for this rank's own
                for x, y in zip(share, grad_kv, strict=True):
                    x.add_(y)
            grad_kv = share
            if cp_size > 1:  # to the rank that holds the block next; after the last step, home
                grad_kv, grad_requests = ring_send_recv(grad_kv, group)
            if step < cp_size - 1:
                for request in requests:
                    request.wait()
                kv = received
        for request in grad_requests:
            request.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None


### end Ring attention
class ContextParallelAttention(nn.Module):
    """A layer's attention on this rank's chunks of the sequence: RoPE turns each token by its
    global position, and attention runs around the ring. It takes over the layer's projections
    under their own names, so the weights and the state dict are those of LlamaAttention."""

    def __init__(self, attention, group):
        super().__init__()
        self.head_dim, self.rope = attention.head_dim, attention.rope
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.group, self.cp_size = group, dist.get_world_size(group)
        self.cp_rank = dist.get_rank(group)
        self.ring = True  # False: the whole sequence is on this rank (`whole_sequence`)

    def forward(self, x):
        if not self.ring:
            return LlamaAttention.forward(self, x)  # the layer's own, on the whole sequence
        B, T, _ = x.shape  # T: this rank's tokens, of T * cp_size in the whole sequence
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, d)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, d)
        cos, sin = rotary_cos_sin(T * self.cp_size, self.head_dim, self.rope, x.device)
        # This rank's tokens sit at the positions of its two chunks: their rows of the rotation.
        where = torch.arange(T * self.cp_size, device=x.device)
        mine = split_sequence(where, self.cp_rank, self.cp_size, dim=0)
        cos, sin = cos[mine], sin[mine]  # (T, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = RingAttention.apply(q, k, v, self.group)  # (B, H, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*d)
        return self.o_proj(y)  # (B, T, D)


def apply_context_parallel(model, group):
    """Swap every layer's attention for its context-parallel version. Call it on the meta
    device, before the weights exist; the projections (maybe tensor-parallel) are kept."""
    check_kernels()
    for layer in model.model.layers:
        layer.self_attn = ContextParallelAttention(layer.self_attn, group)
    return model


@contextmanager
def whole_sequence(model):
    """Within: every rank attends over the whole sequence it is given, as without context
    parallelism (sampling gives every rank the same prompt, of any length)."""
    layers = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    for layer in layers:
        layer.ring = False
    try:
        yield
    finally:
        for layer in layers:
            layer.ring = True
