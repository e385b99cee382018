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
Backward passes the blocks around the ring again; each block's key/value gradients travel with it
and arrive home after the last step.

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

from model import LlamaAttention, apply_rotary, rotary_cos_sin


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


def scores(q, k, causal):
    """Scaled dot products, (B, H, C, C); on the diagonal block a query sees no later key."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    return s


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


def without_autocast(function):
    """Run forward or backward with autocast off on the device of its first tensor: under
    autocast, `@` would compute the fp32 scores and the merge in bf16."""

    @functools.wraps(function)
    def run(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return function(ctx, first, *args)

    return run


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (B, H, T, d) over the whole sequence, whose keys
    and values (B, K, T, d) are spread over the cp group, T = 2 chunks per rank (`chunk_ids`).
    Computed in fp32, returned in the queries' dtype."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, group):
        cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
        H = q.shape[1]
        queries = q.float().chunk(2, dim=2)  # 2 x (B, H, C, d)
        out = [torch.zeros_like(x) for x in queries]
        lse = [torch.full(x.shape[:-1], float("-inf"), device=x.device) for x in queries]
        kv = [k.float().contiguous(), v.float().contiguous()]  # the block held, from `source`
        for step in range(cp_size):
            source = (cp_rank - step) % cp_size
            if step < cp_size - 1:  # the next block travels while this one is computed
                received, requests = ring_send_recv(kv, group)
            keys, values = (expand_heads(x, H).chunk(2, dim=2) for x in kv)
            for i, j, causal in blocks(cp_rank, source, cp_size):
                s = scores(queries[i], keys[j], causal)  # (B, H, C, C)
                block_lse = s.logsumexp(-1)  # (B, H, C)
                block_out = (s - block_lse.unsqueeze(-1)).exp() @ values[j]  # (B, H, C, d)
                out[i], lse[i] = merge(out[i], lse[i], block_out, block_lse)
            if step < cp_size - 1:
                for request in requests:
                    request.wait()
                kv = received
        lse = torch.cat(lse, dim=2)  # (B, H, T)
        # (B, H, T, d), laid out as (B, T, H, d): o_proj's input is then a view, not a copy.
        out = torch.cat(out, dim=2).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
        H, K = q.shape[1], k.shape[1]
        queries = q.float().chunk(2, dim=2)  # 2 x (B, H, C, d)
        grad_out = grad_out.float()
        # softmax backward: dS = P * (dP - rowsum(dO * O)), the row sums once for all blocks
        delta = (grad_out * out).sum(-1).chunk(2, dim=2)  # 2 x (B, H, C)
        grad_out, lse = grad_out.chunk(2, dim=2), lse.chunk(2, dim=2)
        grad_q = [torch.zeros_like(x) for x in queries]
        kv = [k.float().contiguous(), v.float().contiguous()]
        # The gradient of the block held, summed over the ranks it has visited; it travels with it.
        grad_kv = [torch.zeros_like(x) for x in kv]
        for step in range(cp_size):
            source = (cp_rank - step) % cp_size
            if step < cp_size - 1:
                received, requests = ring_send_recv(kv, group)
            keys, values = (expand_heads(x, H).chunk(2, dim=2) for x in kv)
            grad_keys = [torch.zeros_like(x) for x in keys]  # per query head, (B, H, C, d)
            grad_values = [torch.zeros_like(x) for x in values]
            for i, j, causal in blocks(cp_rank, source, cp_size):
                s = scores(queries[i], keys[j], causal)
                p = (s - lse[i].unsqueeze(-1)).exp()  # the final softmax's entries of this block
                grad_values[j] += p.transpose(-1, -2) @ grad_out[i]
                grad_p = grad_out[i] @ values[j].transpose(-1, -2)  # (B, H, C, C)
                grad_s = p * (grad_p - delta[i].unsqueeze(-1)) * q.shape[-1] ** -0.5
                grad_q[i] += grad_s @ keys[j]
                grad_keys[j] += grad_s.transpose(-1, -2) @ queries[i]
            grad_kv[0] += sum_heads(torch.cat(grad_keys, dim=2), K)
            grad_kv[1] += sum_heads(torch.cat(grad_values, dim=2), K)
            if cp_size > 1:  # after the last step, this sends each block's gradient home
                grad_kv, grad_requests = ring_send_recv(grad_kv, group)
                for request in grad_requests:
                    request.wait()
            if step < cp_size - 1:
                for request in requests:
                    request.wait()
                kv = received
        grad_q = torch.cat(grad_q, dim=2).to(q.dtype)
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None


### end Ring attention
class ContextParallelAttention(LlamaAttention):
    """A layer's attention on this rank's chunks of the sequence: RoPE turns each token by its
    global position, and attention runs around the ring. It takes over the layer's projections
    under their own names, so the weights and the state dict are those of LlamaAttention."""

    def __init__(self, attention, group):
        nn.Module.__init__(self)  # LlamaAttention's would build new projections
        self.head_dim, self.rope = attention.head_dim, attention.rope
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.group, self.cp_size = group, dist.get_world_size(group)
        self.cp_rank = dist.get_rank(group)
        self.ring = True  # False: the whole sequence is on this rank (`whole_sequence`)

    def forward(self, x):
        if not self.ring:
            return super().forward(x)
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
