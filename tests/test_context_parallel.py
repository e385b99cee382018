"""Step 11, context parallelism: ring attention gives the output and the gradients of PyTorch's
causal attention on the whole sequence, and a layer's attention those of LlamaAttention; training
at cp 2, cp 2 x tp 2 and pp 2 x cp 2 gives step 3's losses and gradient norms."""

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROOT, TINY, check, run_step, spawn

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

STEP = "step11_context_parallel"
# (B, H, K, T, d): grouped-query (2 and 6 query heads per key/value head) and plain multi-head
SHAPES = [(2, 4, 2, 16, 8), (1, 6, 1, 32, 4), (2, 3, 3, 8, 16)]
TOLERANCE = 1e-5  # fp32: only the order of the sums differs


# ---- ring attention against F.scaled_dot_product_attention on one process ----------------------


def max_difference(got, want):
    return (got - want).abs().max().item()


def ring_against_sdpa(rank, world):
    from context_parallel import RingAttention, split_sequence

    group = dist.new_group(list(range(world)))
    for B, H, K, T, d in SHAPES:
        if T % (2 * world):
            continue
        generator = torch.Generator().manual_seed(T * 1000 + H)
        q, k, v = (torch.randn(B, n, T, d, generator=generator) for n in (H, K, K))
        grad_out = torch.randn(B, H, T, d, generator=generator)
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
        want.backward(grad_out)
        mine = [split_sequence(x, rank, world, dim=2).requires_grad_() for x in (q, k, v)]
        got = RingAttention.apply(*mine, group)
        got.backward(split_sequence(grad_out, rank, world, dim=2))
        pairs = [(got, want)] + [(x.grad, y.grad) for x, y in zip(mine, whole, strict=True)]
        for name, (x, y) in zip(["out", "dq", "dk", "dv"], pairs, strict=True):
            diff = max_difference(x, split_sequence(y, rank, world, dim=2))
            assert diff < TOLERANCE, f"{name} of {(B, H, K, T, d)} on rank {rank}: {diff:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_attention(tmp_path, world):
    spawn(STEP, ring_against_sdpa, world, tmp_path)


def attention_against_llama(rank, world):
    """A layer's attention on this rank's chunks, RoPE at the global positions, against
    LlamaAttention on the whole sequence; the projections' gradients summed over the ranks."""
    from context_parallel import ContextParallelAttention, split_sequence
    from model import LlamaAttention

    group = dist.new_group(list(range(world)))
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    config = SimpleNamespace(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope
    )
    torch.manual_seed(0)
    reference = LlamaAttention(config)
    attention = LlamaAttention(config)
    attention.load_state_dict(reference.state_dict())
    attention = ContextParallelAttention(attention, group)
    x = torch.randn(2, 16, 32)
    grad_out = torch.randn(2, 16, 32)
    want = reference(x)
    want.backward(grad_out)
    got = attention(split_sequence(x, rank, world))
    got.backward(split_sequence(grad_out, rank, world))
    assert max_difference(got, split_sequence(want, rank, world)) < TOLERANCE
    for name, param in attention.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each rank's tokens add to the gradient
        diff = max_difference(param.grad, reference.get_parameter(name).grad)
        assert diff < TOLERANCE, f"{name}.grad on rank {rank}: {diff:.2e}"
    with torch.no_grad():  # sampling: every rank the whole sequence, no ring
        from context_parallel import whole_sequence

        with whole_sequence(attention):
            assert max_difference(attention(x), want) == 0


def test_layer_attention_equals_llama_attention(tmp_path):
    spawn(STEP, attention_against_llama, 2, tmp_path)
