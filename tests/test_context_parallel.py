"""Step 11, context parallelism: ring attention gives the output and the gradients of PyTorch's
causal attention on the whole sequence, and a layer's attention those of LlamaAttention; training
at cp 2, cp 2 x tp 2 and pp 2 x cp 2 gives step 3's losses and gradient norms."""

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    ROOT,
    TINY,
    assert_same_training,
    assert_weights_readable_as_config,
    check,
    read_log,
    run_step,
    spawn,
)

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

STEP = "step11_context_parallel"
# (B, H, K, T, d): grouped-query (2 and 6 query heads per key/value head) and plain multi-head
SHAPES = [(2, 4, 2, 16, 8), (1, 6, 1, 32, 4), (2, 3, 3, 8, 16)]
TOLERANCE = 1e-5  # fp32: only the order of the sums differs


# ---- ring attention against F.scaled_dot_product_attention on one process ----------------------


def max_difference(got, want):
    return (got - want).abs().max().item()


def ring_against_sdpa(rank, group):
    from context_parallel import RingAttention, split_sequence

    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    for B, H, K, T, d in SHAPES:
        if T % (2 * cp_size):
            continue
        generator = torch.Generator().manual_seed(T * 1000 + H)
        q, k, v = (torch.randn(B, n, T, d, generator=generator) for n in (H, K, K))
        grad_out = torch.randn(B, H, T, d, generator=generator)
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
        want.backward(grad_out)
        mine = [split_sequence(x, cp_rank, cp_size, dim=2).requires_grad_() for x in (q, k, v)]
        got = RingAttention.apply(*mine, group)
        got.backward(split_sequence(grad_out, cp_rank, cp_size, dim=2))
        pairs = [(got, want)] + [(x.grad, y.grad) for x, y in zip(mine, whole, strict=True)]
        for name, (x, y) in zip(["out", "dq", "dk", "dv"], pairs, strict=True):
            diff = max_difference(x, split_sequence(y, cp_rank, cp_size, dim=2))
            where = f"{(B, H, K, T, d)} at cp {cp_size}, rank {rank}"
            assert diff < TOLERANCE, f"{name} of {where}: {diff:.2e}"


def ring_ignores_autocast(group):
    """Under bf16 autocast the ring still computes in fp32: the same bits as without it."""
    from context_parallel import RingAttention

    generator = torch.Generator().manual_seed(dist.get_rank(group))
    q, k, v = (torch.randn(2, n, 8, 8, generator=generator).bfloat16() for n in (4, 2, 2))
    plain = RingAttention.apply(q, k, v, group)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(RingAttention.apply(q, k, v, group), plain)


def grid_checks(rank):
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


def attention_checks(rank, world):
    """On 4 ranks: the grid's groups; ring attention over all 4, then over two rings of 2 side by
    side, and a layer's attention over the rings of 2."""
    grid_checks(rank)
    ring4 = dist.new_group(list(range(world)))
    pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank makes both
    ring2 = pairs[rank // 2]
    ring_against_sdpa(rank, ring4)
    ring_against_sdpa(rank, ring2)
    ring_ignores_autocast(ring2)
    activations_fall_as_one_over_cp(rank, ring4)
    attention_against_llama(rank, ring2)


def test_ring_attention_equals_full_attention(tmp_path):
    spawn(STEP, attention_checks, 4, tmp_path)


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
    diff = max_difference(got, split_sequence(want, cp_rank, cp_size))
    assert diff < TOLERANCE, f"output on rank {rank}: {diff:.2e}"
    for name, param in attention.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each rank's tokens add to the gradient
        diff = max_difference(param.grad, reference.get_parameter(name).grad)
        assert diff < TOLERANCE, f"{name}.grad on rank {rank}: {diff:.2e}"
    with torch.no_grad(), whole_sequence(attention):  # sampling: the whole sequence, no ring
        assert max_difference(attention(x), want) == 0


# ---- training against step 3 -------------------------------------------------------------------

ACCUMULATION = 2  # the baseline's; the dp 2 layout takes 1
COMMON = [*TINY, "--max_steps", "8", "--eval_every", "4", "--eval_steps", "2"]
COMMON += ["--num_proc", "1", "--sample_tokens", "4"]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
LAYOUTS = {layout.name: layout for layout in convergence.cp_layouts(ACCUMULATION)}
TRAINED = ["cp2", "cp2_tp2", "dp2_pp2_cp2"]  # pp2_cp2 is in the 4D one


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Step 3 on one process, and step 11 at cp 2 (saving at steps 4 and 8), cp 2 x tp 2 and
    dp 2 x pp 2 x cp 2, each run once for all the tests below."""
    out_dir = tmp_path_factory.mktemp("cp")
    layouts = [convergence.baseline_layout(ACCUMULATION)] + [LAYOUTS[name] for name in TRAINED]
    save = ["--save_dir", str(out_dir / "ckpt"), "--save_every", "4"]
    runs = {
        layout.name: convergence.run(
            layout, [*COMMON, *save] if layout.name == "cp2" else COMMON, out_dir, env=ENV
        )
        for layout in layouts
    }
    return {**runs, "save_dir": out_dir / "ckpt"}


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
