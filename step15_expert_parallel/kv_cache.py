"""A key/value cache for generation: each new token attends to the keys and values of the tokens
before it, kept from earlier calls, instead of recomputing the whole prefix at every token.

    with kv_cache(model):          # every attention layer of this rank now caches
        logits = model(prompt)     # (1, T, V): the prompt, once
        logits = model(next_id)    # (1, 1, V): one token, at position T

model.py stays as it is: within `kv_cache`, every attention layer of the model (whatever its
class: a tensor-parallel rank's, with its own heads; a pipeline stage's, with its own layers)
runs `cached_attention`, which calls the layer's own projections, so what the layer computes is
the training forward's on the tokens it is given, at their positions after the cached ones.
Leaving the context restores the layers' own forward; training never sees the cache.
"""

# B batch, T new tokens, S cached + new tokens, H query heads, K key/value heads, d head dim

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from model import apply_rotary, rotary_cos_sin


def cached_attention(attention, cache, x):
    """The layer's attention on the T new tokens of x, which follow the cached ones."""
    B, T, _ = x.shape
    d = attention.head_dim
    q = attention.q_proj(x).view(B, T, -1, d).transpose(1, 2)  # (B, H, T, d)
    k = attention.k_proj(x).view(B, T, -1, d).transpose(1, 2)  # (B, K, T, d)
    v = attention.v_proj(x).view(B, T, -1, d).transpose(1, 2)  # (B, K, T, d)
    past_k, past_v = cache.get(attention, (k[:, :, :0], v[:, :, :0]))
    start = past_k.shape[2]  # the new tokens' first position
    cos, sin = rotary_cos_sin(start + T, d, attention.rope, x.device)
    q, k = apply_rotary(q, cos[start:], sin[start:]), apply_rotary(k, cos[start:], sin[start:])
    k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)  # (B, K, S, d)
    cache[attention] = (k, v)
    if start == 0:  # the prompt: causal, as in training
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, d)
    else:  # new token t, at position start + t, sees the positions up to its own
        where = torch.arange(start + T, device=x.device)  # (S,)
        seen = where <= start + torch.arange(T, device=x.device)[:, None]  # (T, S)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
    y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*d)
    return attention.o_proj(y)  # (B, T, D)


@contextmanager
def kv_cache(model):
    """Within: every attention layer of `model` (a module with q_, k_, v_ and o_proj) caches its
    keys and values, rotated, in one dict kept for the context's length."""
    cache = {}
    layers = [m for m in model.modules() if all(hasattr(m, f"{p}_proj") for p in "qkvo")]
    for layer in layers:
        layer.forward = lambda x, layer=layer: cached_attention(layer, cache, x)
    try:
        yield cache
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again
