"""Step 11, context parallelism: each block of ring attention, on a fused kernel, gives the output,
log-sum-exp and gradients of the readable version that materialises its scores; two blocks merge
into attention over both, each rank computes its share of the causal blocks, and the ring passes
each tensor to the next rank; ring attention gives the output and the gradients of PyTorch's causal
attention on the whole sequence, with the memory of a few (T/cp, d) tensors per rank at 16 k tokens,
and a layer's attention those of LlamaAttention; training at cp 2, cp 2 x tp 2 and pp 2 x cp 2 gives
step 3's losses and gradient norms."""

import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    ROOT,
    TINY,
    assert_matches,
    assert_same_training,
    assert_weights_readable_as_config,
    check,
    import_step,
    read_log,
    run_step,
    spawn,
    step_dir,
)

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

STEP = "step11_context_parallel"
# (B, H, K, T, d): grouped-query (2 and 6 query heads per key/value head) and plain multi-head
SHAPES = [(2, 4, 2, 16, 8), (1, 6, 1, 32, 4), (2, 3, 3, 8, 16)]
TOLERANCE = 1e-5  # fp32: only the order of the sums differs


# ---- one block: the fused kernel against the readable version ---------------------------------


def math_attend(q, k, v, causal):
    """`attend` as the lesson writes it, the reference of the fused kernels: the block's (C, C)
    scores materialised, its log-sum-exp, the softmax within the block times the values."""
    from context_parallel import expand_heads

    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])  # (B, H, C, d)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, C, C)
    if causal:  # on the diagonal block a query sees no later key
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    lse = s.logsumexp(-1)  # (B, H, C)
    return (s - lse.unsqueeze(-1)).exp() @ v, lse


def math_attend_backward(grad_out, q, k, v, out, lse, causal):
    """`attend_backward` as the lesson writes it: the final softmax's entries of this block,
    P = exp(s - lse), and dS = P * (dP - rowsum(dO * O))."""
    from context_parallel import expand_heads, sum_heads

    K, k, v = k.shape[1], expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    p = (s - lse.unsqueeze(-1)).exp()  # (B, H, C, C)
    grad_v = p.transpose(-1, -2) @ grad_out
    grad_p = grad_out @ v.transpose(-1, -2)  # (B, H, C, C)
    delta = (grad_out * out).sum(-1, keepdim=True)  # (B, H, C, 1)
    grad_s = p * (grad_p - delta) * q.shape[-1] ** -0.5
    return grad_s @ k, sum_heads(grad_s.transpose(-1, -2) @ q, K), sum_heads(grad_v, K)


# (B, H, K, queries, keys, d, causal): GQA, a rectangle without mask, a length not a multiple of 32
BLOCKS = [(2, 4, 2, 16, 16, 8, True), (1, 6, 1, 24, 40, 4, False), (2, 3, 3, 33, 33, 16, True)]
# fp64 and fp32: the order of sums only; bf16 against the fp64 reference: its rounding
BLOCK_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def relative_difference(got, want):
    """max |got - want| relative to the reference's largest entry (at least 1)."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()


def check_blocks(device, dtype):
    """`attend` against `math_attend` in fp64 on the same (rounded) inputs, and `attend_backward`
    given the output and lse of a softmax over more keys than the block's (another block of
    keys seen in full): the block's share of the gradient, as the ring uses it."""
    context_parallel = import_step(STEP, "context_parallel")
    for B, H, K, C, S, d, causal in BLOCKS:
        generator = torch.Generator().manual_seed(C * 100 + S)
        q, grad_out = (torch.randn(B, H, C, d, generator=generator) for _ in range(2))
        k, v, other_k, other_v = (torch.randn(B, K, S, d, generator=generator) for _ in range(4))
        inputs = [x.to(device, dtype) for x in (q, k, v, other_k, other_v, grad_out)]
        q, k, v, other_k, other_v, grad_out = (x.double() for x in inputs)  # the rounded values
        where = f"{(B, H, K, C, S, d, causal)} {dtype} on {device.type}"

        got = context_parallel.attend(*inputs[:3], causal)
        want = math_attend(q, k, v, causal)
        for name, x, y in zip(["out", "lse"], got, want, strict=True):
            diff = relative_difference(x, y)
            assert diff < BLOCK_TOLERANCE[dtype], f"{name} of {where}: {diff:.2e}"

        # The whole softmax over [the other keys, this block's]: its output and lse.
        other = math_attend(q, other_k, other_v, False)
        out, lse = context_parallel.merge(*other, *want)
        lse_dtype = torch.promote_types(dtype, torch.float32)  # the kernels' lse: fp32, fp64
        got = context_parallel.attend_backward(
            inputs[5], *inputs[:3], out.to(dtype), lse.to(lse_dtype), causal
        )
        want = math_attend_backward(grad_out, q, k, v, out, lse, causal)
        for name, x, y in zip(["dq", "dk", "dv"], got, want, strict=True):
            assert x.shape == y.shape, f"{name} of {where}: {x.shape}"
            diff = relative_difference(x, y)
            assert diff < BLOCK_TOLERANCE[dtype], f"{name} of {where}: {diff:.2e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_block_equals_math(dtype):
    check_blocks(torch.device("cpu"), dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_equals_math_on_cuda(dtype):
    check_blocks(torch.device("cuda"), dtype)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_kernel_calls_match_their_schemas(kernel):
    """Without a GPU: the CUDA kernels' calls, on meta tensors (shapes only), take their
    arguments and give the block's shapes: its output, its lse unpadded, dk and dv with K heads."""
    context_parallel = import_step(STEP, "context_parallel")
    for dtype in [torch.bfloat16, torch.float32]:
        q = torch.empty(2, 4, 40, 16, device="meta", dtype=dtype)  # (B, H, C, d), C = 40
        k = torch.empty(2, 2, 40, 16, device="meta", dtype=dtype)
        out, lse = context_parallel.attend_cuda(q, k, k, True, kernel)
        assert (out.shape, out.dtype) == (q.shape, dtype)
        assert (lse.shape, lse.dtype) == ((2, 4, 40), torch.float32)
        grads = context_parallel.attend_backward_cuda(out, q, k, k, out, lse, True, kernel)
        assert [x.shape for x in grads] == [q.shape, k.shape, k.shape]


def test_a_kernel_of_another_signature_is_refused(monkeypatch):
    """The private kernels' schemas are checked before any is called: this torch's match the
    calls; a kernel that takes other arguments, or gives fewer results than are read, is refused
    with its name and the torch version."""
    context_parallel = import_step(STEP, "context_parallel")
    context_parallel.check_kernels()
    name = "_scaled_dot_product_flash_attention_for_cpu"
    arguments, results = context_parallel.KERNELS[name]
    version = re.escape(torch.__version__)
    for wrong in [
        ([arguments[0], arguments[2], arguments[1], *arguments[3:]], results),
        (arguments, 3),
    ]:
        monkeypatch.setitem(context_parallel.KERNELS, name, wrong)
        with pytest.raises(
            ValueError, match=rf"calls aten\.{name}\(.* but torch {version} defines"
        ):
            context_parallel.check_kernels()


# ---- the pieces of the ring: the merge, the blocks, the messages ------------------------------


def test_merge_gives_attention_over_both_blocks():
    """merge: the outputs and lse of attention over two disjoint sets of keys (`math_attend`, in
    fp64), merged, are those of attention over both; from the start (out 0, lse -inf) a block
    merges into itself; and an lse near 1000, which large scores give, merges as well."""
    context_parallel = import_step(STEP, "context_parallel")
    B, H, C, S, d = 2, 4, 8, 12, 16  # queries, and S + C keys split in two
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, C, d, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, H, S + C, d, generator=generator, dtype=torch.float64) for _ in "kv")
    first = math_attend(q, k[:, :, :S], v[:, :, :S], False)
    second = math_attend(q, k[:, :, S:], v[:, :, S:], False)
    want = math_attend(q, k, v, False)
    empty = torch.zeros_like(first[0]), torch.full_like(first[1], -torch.inf)
    shift = 1000.0  # exp(1000) overflows even fp64: the merge must not compute it
    cases = [
        ("two blocks", (*first, *second), want),
        ("the first block onto nothing (lse -inf)", (*empty, *first), first),
        (
            f"two blocks whose lse are {shift:g} larger",
            (first[0], first[1] + shift, second[0], second[1] + shift),
            (want[0], want[1] + shift),
        ),
    ]
    for case, inputs, expected in cases:
        (out, lse), over = context_parallel.merge(*inputs), "attention over their keys"
        # the lse first: the outputs' weights follow from it
        for name, x, y in [("lse", lse, expected[1]), ("out", out, expected[0])]:
            assert_matches(x, y, f"merge of {case}: {name}", rtol=0, atol=1e-12, reference=over)


def test_blocks_are_the_causal_half_shared_evenly():
    """blocks: over the cp_size steps of the ring, rank r computes, once each, the (query chunk,
    key chunk) blocks of its two query chunks in which some key is not after every query:
    causal on the diagonal, and as many on every rank (2 cp_size + 1); each step's in order,
    query chunk first (as `spans` reads them)."""
    context_parallel = import_step(STEP, "context_parallel")
    chunk_ids, blocks = context_parallel.chunk_ids, context_parallel.blocks
    for cp_size in (1, 2, 3, 4):
        for rank in range(cp_size):
            seen = []
            for source in range(cp_size):
                found = list(blocks(rank, source, cp_size))
                where = f"blocks(cp_rank={rank}, source={source}, cp_size={cp_size}) gives {found}"
                assert found == sorted(found), f"{where}: in order, query chunk first"
                queries, keys = chunk_ids(rank, cp_size), chunk_ids(source, cp_size)
                for i, j, causal in found:
                    pair = f"query chunk {queries[i]}, key chunk {keys[j]}"
                    assert keys[j] <= queries[i], f"{where}: ({pair}): every key after every query"
                    assert causal == (keys[j] == queries[i]), f"{where}: ({pair}) causal={causal}"
                    seen.append((queries[i], keys[j]))
            want = [(q, k) for q in sorted(chunk_ids(rank, cp_size)) for k in range(q + 1)]
            assert sorted(seen) == want, (
                f"blocks: over the ring, rank {rank} of cp_size {cp_size} computes the (query "
                f"chunk, key chunk) blocks {sorted(seen)}, expected {want}"
            )
            # chunks r and 2 cp_size - 1 - r: r + 1 blocks and 2 cp_size - r, on every rank
            assert len(seen) == 2 * cp_size + 1, (
                f"rank {rank} of cp_size {cp_size} computes {len(seen)} blocks, every rank "
                f"{2 * cp_size + 1} (chunk_ids: {chunk_ids(rank, cp_size)})"
            )


def ring_send_recv_checks(rank, world):
    """Around the ring of 4 ranks, and around two rings of 2 whose group ranks are not their
    global ranks ([0, 2] and [1, 3]): each rank receives what the rank before it sent."""
    from context_parallel import ring_send_recv

    ring4 = dist.new_group(list(range(world)))
    pairs = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]  # every rank makes both
    for ranks, group in [(list(range(world)), ring4), ([rank % 2, rank % 2 + 2], pairs[rank % 2])]:
        sent = [torch.full((2, 3), 10.0 * rank), torch.arange(4.0) + rank]  # two shapes
        received, requests = ring_send_recv(sent, group)
        for request in requests:
            request.wait()
        before = ranks[(ranks.index(rank) - 1) % len(ranks)]
        want = [torch.full((2, 3), 10.0 * before), torch.arange(4.0) + before]
        for i, (got, expected) in enumerate(zip(received, want, strict=True)):
            what = f"ring_send_recv over the ring {ranks}: tensor {i} received"
            by = f"rank {before}, the one before, sent"
            assert_matches(got, expected, what, rtol=0, atol=0, reference=by)


def test_ring_send_recv_passes_to_the_next_rank(tmp_path):
    spawn(STEP, ring_send_recv_checks, 4, tmp_path, timeout=60)


# ---- ring attention against F.scaled_dot_product_attention on one process ----------------------


def max_difference(got, want):
    return (got - want).abs().max().item()


# The ring in each dtype against SDPA on the whole sequence: fp32 as before (only the order of the
# sums differs), fp64 within rounding, bf16 (blocks in bf16, the merge in fp32) against fp64,
# relative to the largest entry (bf16 keeps 8 bits of each number).
RING_DTYPES = {torch.float32: (torch.float32, TOLERANCE), torch.float64: (torch.float64, 1e-12)}
RING_DTYPES[torch.bfloat16] = (torch.float64, 2e-2)


def ring_against_sdpa(rank, group, backward=True):
    """The ring's output, then (`backward`) its dq, dk and dv, each against SDPA's on the whole
    sequence, this rank's chunks of it."""
    from context_parallel import RingAttention, split_sequence

    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    for (B, H, K, T, d), dtype in [(shape, d) for shape in SHAPES for d in RING_DTYPES]:
        if T % (2 * cp_size):
            continue
        reference, tolerance = RING_DTYPES[dtype]
        generator = torch.Generator().manual_seed(T * 1000 + H)
        q, k, v = (torch.randn(B, n, T, d, generator=generator).to(dtype) for n in (H, K, K))
        grad_out = torch.randn(B, H, T, d, generator=generator).to(dtype)
        whole = [x.to(reference, copy=True).requires_grad_() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
        want.backward(grad_out.to(reference))
        mine = [split_sequence(x, cp_rank, cp_size, dim=2).requires_grad_() for x in (q, k, v)]
        got = RingAttention.apply(*mine, group)
        pairs = {("RingAttention.forward", "out"): (got, want)}
        if backward:
            got.backward(split_sequence(grad_out, cp_rank, cp_size, dim=2))
            for name, x, y in zip(["dq", "dk", "dv"], mine, whole, strict=True):
                pairs["RingAttention.backward", name] = (x.grad, y.grad)
        shape = f"(B, H, K, T, d) = {(B, H, K, T, d)}, {dtype}, cp {cp_size}"
        for (function, name), (x, y) in pairs.items():
            what = f"{function} at {shape}: {name}"
            assert x.dtype == dtype, f"{what} is {x.dtype}"
            y = split_sequence(y, cp_rank, cp_size, dim=2)
            # bf16: relative to the largest entry of the reference
            scale = y.abs().max().item() if dtype == torch.bfloat16 else 1.0
            assert_matches(
                x.to(reference), y, what, rtol=0, atol=tolerance * scale,
                reference="SDPA on the whole sequence",
            )  # fmt: skip


def ring_ignores_autocast(group):
    """Under bf16 autocast the ring computes as without it (blocks in the inputs' dtype, the merge
    in fp32): the same bits."""
    from context_parallel import RingAttention

    generator = torch.Generator().manual_seed(dist.get_rank(group))
    q, k, v = (torch.randn(2, n, 8, 8, generator=generator).bfloat16() for n in (4, 2, 2))
    plain = RingAttention.apply(q, k, v, group)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(RingAttention.apply(q, k, v, group), plain)


def grid_checks(rank, world):
    """The 4D grid of 4 ranks: tp fastest, then cp; the dp x cp group holds the same weights."""
    from process_group_manager import ProcessGroupManager

    def members(group):
        return dist.get_process_group_ranks(group)

    pgm = ProcessGroupManager(2, 1, 1, 2)  # tp 2 x cp 2
    assert (pgm.tp_rank, pgm.cp_rank) == (rank % 2, rank // 2)
    assert pgm.tp_group_ids == members(pgm.tp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert pgm.cp_group_ids == members(pgm.cp_group) == [rank % 2, rank % 2 + 2]
    assert pgm.dp_cp_group_ids == members(pgm.dp_cp_group) == [rank % 2, rank % 2 + 2]
    pgm = ProcessGroupManager(1, 1, 2, 2)  # dp 2 x cp 2
    assert (pgm.dp_rank, pgm.cp_rank) == (rank // 2, rank % 2)
    assert pgm.cp_group_ids == members(pgm.cp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert pgm.dp_group_ids == members(pgm.dp_group) == [rank % 2, rank % 2 + 2]
    assert pgm.dp_cp_group_ids == members(pgm.dp_cp_group) == [0, 1, 2, 3]


def saved_bytes(model, ids):
    """The bytes of activations one forward keeps for backward: each storage once, no weights."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(tensor):
        seen.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids).sum().backward()
    return sum(size for pointer, size in seen if pointer not in weights)


def activations_fall_as_one_over_cp(rank, group):
    """A rank of cp ranks keeps 1/cp of the activations that one rank keeps for the whole row."""
    from transformers import AutoConfig

    from context_parallel import apply_context_parallel, split_sequence
    from model import LlamaForCausalLM

    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    config = AutoConfig.from_pretrained(str(ROOT / "assets" / "configs" / "tiny"))
    config.num_hidden_layers, config.hidden_size, config.head_dim = 2, 64, 16
    config.intermediate_size, config.num_attention_heads, config.num_key_value_heads = 128, 4, 2
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    whole = saved_bytes(LlamaForCausalLM(config), ids)
    model = apply_context_parallel(LlamaForCausalLM(config), group)
    mine = saved_bytes(model, split_sequence(ids, cp_rank, cp_size))
    assert mine * cp_size == whole, f"cp {cp_size}: {mine} bytes per rank, {whole} at cp 1"


def test_the_grid_orders_tp_cp_dp(tmp_path):
    spawn(STEP, grid_checks, 4, tmp_path)


def attention_checks(rank, world, part):
    """On 4 ranks: ring attention over all 4, then over two rings of 2 side by side: its forward
    (also under autocast), forward and backward, or a layer's attention and a model's
    activations."""
    ring4 = dist.new_group(list(range(world)))
    pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank makes both
    ring2 = pairs[rank // 2]
    if part == "forward":
        ring_against_sdpa(rank, ring4, backward=False)
        ring_against_sdpa(rank, ring2, backward=False)
        ring_ignores_autocast(ring2)
    elif part == "backward":
        ring_against_sdpa(rank, ring4)
        ring_against_sdpa(rank, ring2)
    else:
        attention_against_llama(rank, ring2)
        activations_fall_as_one_over_cp(rank, ring4)


@pytest.mark.parametrize("part", ["forward", "backward", "layer"])
def test_ring_attention_equals_full_attention(tmp_path, part):
    spawn(STEP, attention_checks, 4, tmp_path, part)


# ---- memory at a long sequence ----------------------------------------------------------------

LONG = (1, 2, 1, 16384, 8)  # (B, H, K, T, d): 16 k tokens, cp 2: chunks of 4,096
STATUS = Path("/proc/self/status")


def resident(field):
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in bytes."""
    return int(re.search(rf"{field}:\s+(\d+) kB", STATUS.read_text()).group(1)) * 1024


def peak_bytes(function):
    """The most memory `function` held at once, as the peak of this process's resident memory
    over the resident memory it started with (Linux: the peak is reset by writing 5 to
    /proc/self/clear_refs). Big buffers are mapped and unmapped whole, so each counts."""
    Path("/proc/self/clear_refs").write_text("5")
    start = resident("VmRSS")
    function()
    return resident("VmHWM") - start


def ring_memory(rank, world):
    """At cp 2 and 16 k tokens a rank of ring attention holds, forward and backward, a few tensors
    of its (T/cp, d) shape: under a limit of 32 times its queries' bytes (16 MiB), which one block
    of (C, C) fp32 scores (128 MiB for its 2 heads) alone would exceed; and it saves for backward
    exactly q, k, v, the output and the lse."""
    from context_parallel import RingAttention, split_sequence

    B, H, K, T, d = LONG
    generator = torch.Generator().manual_seed(0)
    whole = [torch.randn(B, n, T, d, generator=generator) for n in (H, K, K, H)]
    q, k, v, grad_out = (split_sequence(x, rank, world, dim=2) for x in whole)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    saved = []

    def step():
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            out = RingAttention.apply(*leaves, dist.group.WORLD)
        out.backward(grad_out)

    step()  # the first step allocates what every step reuses (gloo's, the allocator's)
    saved.clear()
    peak = peak_bytes(step)
    limit = 32 * q.nbytes
    C = T // (2 * world)
    block = B * H * C * C * 4  # one (C, C) block of fp32 scores
    print(f"rank {rank}: {peak:,} bytes at peak, limit {limit:,}, one block of scores {block:,}")
    assert peak < limit < block, f"rank {rank}: {peak:,} bytes at peak, limit {limit:,}"
    # the measure sees a block of scores, were one materialised
    assert peak_bytes(lambda: torch.ones(B, H, C, C)) > limit
    want = 2 * q.nbytes + k.nbytes + v.nbytes + B * H * (T // world) * 4  # out like q, lse fp32
    assert sum(x.nbytes for x in saved) == want, [x.shape for x in saved]


@pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc (Linux)")
def test_ring_attention_memory_at_16k_tokens(tmp_path):
    spawn(STEP, ring_memory, 2, tmp_path)


def attention_against_llama(rank, group):
    """A layer's attention on this rank's chunks, RoPE at the global positions, against
    LlamaAttention on the whole sequence; the projections' gradients summed over the ranks."""
    from context_parallel import ContextParallelAttention, split_sequence, whole_sequence
    from model import LlamaAttention

    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
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
    got = attention(split_sequence(x, cp_rank, cp_size))
    got.backward(split_sequence(grad_out, cp_rank, cp_size))
    what, llama = "ContextParallelAttention.forward", "LlamaAttention on the whole sequence"
    expected = split_sequence(want, cp_rank, cp_size)
    assert_matches(got, expected, f"{what}: output", rtol=0, atol=TOLERANCE, reference=llama)
    for name, param in attention.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each rank's tokens add to the gradient
        expected = reference.get_parameter(name).grad
        grad = f"{what} (the gradients summed over cp): {name}.grad"
        assert_matches(param.grad, expected, grad, rtol=0, atol=TOLERANCE, reference=llama)
    with torch.no_grad(), whole_sequence(attention):  # sampling: the whole sequence, no ring
        assert max_difference(attention(x), want) == 0


# ---- training against step 3 -------------------------------------------------------------------

ACCUMULATION = 2  # the baseline's; the dp 2 layout takes 1
COMMON = [*TINY, "--max_steps", "8", "--eval_every", "4", "--eval_steps", "2"]
COMMON += ["--num_proc", "1", "--sample_tokens", "4"]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
LAYOUTS = {layout.name: layout for layout in convergence.cp_layouts(ACCUMULATION)}
TRAINED = ["cp2", "cp2_tp2", "dp2_pp2_cp2"]  # pp2_cp2 is in the 4D one


class Runs(dict):
    """Step 3 on one process, and step 11 at cp 2 (saving at steps 4 and 8), cp 2 x tp 2 and
    dp 2 x pp 2 x cp 2: each run the first time a test asks for it, once for all the tests
    below (a grade of the exercise runs only cp 2 and the baseline, and a failing run fails its
    test). Step 11 runs from the folder that --step names: convergence.run joins a layout's step
    to the repository's root, which leaves an absolute path as it is."""

    def __init__(self, out_dir):
        super().__init__(save_dir=out_dir / "ckpt")
        self.out_dir = out_dir
        self.layouts = {"baseline": convergence.baseline_layout(ACCUMULATION), **LAYOUTS}

    def __missing__(self, name):
        layout = self.layouts[name]
        layout = replace(layout, step=str(step_dir(layout.step)))
        save = ["--save_dir", str(self["save_dir"]), "--save_every", "4"]
        args = [*COMMON, *save] if name == "cp2" else COMMON
        self[name] = convergence.run(layout, args, self.out_dir, env=ENV)
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("cp"))


@pytest.mark.parametrize("name", TRAINED)
def test_trains_like_step3(runs, name):
    """The same losses, gradient norms and validation losses as one process, at every step."""
    comparison = convergence.compare(runs[name], runs["baseline"])
    print(f"\n{convergence.table({name: comparison})}")
    assert comparison.ok, comparison.problems
    assert [r["step"] for r in runs[name] if "val_loss" in r] == [4, 8]
    assert_same_training(runs[name], runs["baseline"])


def test_cp2_checkpoint_resumes_on_one_process(runs, tmp_path):
    """Saved at step 4 at cp 2 (AdamW's moments sharded over the two cp ranks), resumed by one
    process: steps 5 to 8 are the baseline's."""
    runs["cp2"]  # trained, saving at steps 4 and 8
    save = runs["save_dir"]
    assert_weights_readable_as_config(save / "step_000004")
    (save / "latest").write_text("step_000004")  # as if the run had died after step 4
    log_file = tmp_path / "resumed.jsonl"
    args = [*COMMON, "--gradient_accumulation_steps", str(ACCUMULATION), "--save_dir", str(save)]
    result = check(run_step(STEP, [*args, "--resume", "--log_file", str(log_file)]))
    assert "saved at tp 1 x pp 1 x dp 1 x cp 2, running at tp 1 x pp 1 x dp 1 x cp 1" in (
        result.stdout
    ), result.stdout[-2000:]
    resumed = read_log(log_file)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert_same_training(resumed, runs["baseline"][4:])


def test_seq_len_that_cp_cannot_split_is_refused():
    args = [*TINY, "--cp_size", "2", "--seq_len", "30"]
    result = run_step(STEP, args, torchrun=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "seq_len=30 is not a multiple of 2 * cp_size = 4" in result.stderr
    assert "seq_len=28 would work" in result.stderr
    assert "Traceback" not in result.stderr
