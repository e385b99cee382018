"""Step 13: sequence parallelism and recomputation. Each piece against one process (the
sequence's all-gather and reduce-scatter, f and g made of them, a norm on a rank's tokens, the
model they make; recomputation of a function, of attention, of each layer). At tp 2 the model's
loss and every gradient are one process's, with and without sequence parallelism and in each
--recompute mode (those bit-identical to none); PyTorch's DTensor `SequenceParallel` plan gives the
same loss and gradients from the same weights; the ranks send what plain tensor parallelism sends,
cut into reduce-scatters and all-gathers (recomputation sends the layers' forward again); the
bytes kept for backward follow tools/activation_memory.py's formula; the harness layouts train
like one process; what cannot work is refused before the first step."""

import sys
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROOT, TINY, assert_matches, assert_refused, import_step, spawn, step_dir

sys.path.insert(0, str(ROOT / "tools"))
import activation_memory  # noqa: E402
import convergence  # noqa: E402
from memory_table import SavedTensors  # noqa: E402
from steps import carriers  # noqa: E402

S13 = "step13_sequence_parallel"
# The steps that carry step 13's code: its detailed checks run on each one's copy.
CARRIERS = carriers("sequence_parallel.py", S13)
STEP_IDS = {"ids": lambda step: step.split("_")[0]}
LAYOUTS = [(False, "none"), (True, "none"), (True, "selective"), (True, "full"), (False, "full")]


def build(world, sp, mode, extra=()):
    import train

    from process_group_manager import ProcessGroupManager

    flags = [*TINY, "--tp_size", str(world), "--recompute", mode, *extra]
    args = train.parse_args([*flags, "--sequence_parallel"] if sp else flags)
    pgm = ProcessGroupManager(world, 1, 1, 1)
    ctx = train.Context(args, torch.device("cpu"), torch.float32, pgm)
    config = train.load_config(args)
    return train.build_model(ctx, config), config, pgm


def dense(config, seed):
    """The single-device model, from the same seed."""
    import train

    with torch.device("meta"):
        model = train.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed)
    return model


def batch(config):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 33), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# ---- each piece against one process: the graded steps of the exercise --------------------------

SHAPE = (3, 8, 5)  # (B, T, D): the sequence cut in tp pieces


def seeded(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def check_gather_sequence(ctx):
    """gather_sequence: the tp ranks' pieces of the sequence, side by side along dim 1 (in fp32
    and fp64); over a group of one rank, the piece."""
    from sequence_parallel import gather_sequence

    for dtype in (torch.float32, torch.float64):
        whole = seeded(SHAPE, 0, dtype)
        mine = whole.chunk(ctx.world, dim=1)[ctx.rank]  # (B, T/tp, D), no contiguous tensor
        what, reference = f"gather_sequence of the tp ranks' {dtype} pieces", "the whole sequence"
        got = gather_sequence(mine, ctx.group)
        assert_matches(got, whole, what, rtol=0, atol=0, reference=reference)
    got = gather_sequence(mine, ctx.alone)
    what = "gather_sequence over a group of one rank"
    assert_matches(got, mine, what, rtol=0, atol=0, reference="its piece")


def check_reduce_scatter_sequence(ctx):
    """reduce_scatter_sequence: the sum of the ranks' (B, T, D), this rank's tokens of it (in fp32
    and fp64); over a group of one rank, its own."""
    from sequence_parallel import reduce_scatter_sequence

    for dtype in (torch.float32, torch.float64):
        parts = [seeded(SHAPE, r, dtype) for r in range(ctx.world)]
        got = reduce_scatter_sequence(parts[ctx.rank], ctx.group)
        want = sum(parts).chunk(ctx.world, dim=1)[ctx.rank]
        what = f"reduce_scatter_sequence of the ranks' {dtype} partial sums"
        reference = "this rank's tokens of their sum"
        assert_matches(got, want, what, rtol=1e-6, atol=1e-6, reference=reference)
    got = reduce_scatter_sequence(parts[ctx.rank], ctx.alone)
    what = "reduce_scatter_sequence over a group of one rank"
    assert_matches(got, parts[ctx.rank], what, rtol=0, atol=0, reference="its own")


def check_f(ctx):
    """GatherSequence, f: forward, the whole sequence; backward, each rank's gradient of it is a
    partial sum for every token (from its heads, its slice of the MLP): this rank's tokens of
    their sum."""
    from sequence_parallel import GatherSequence

    whole = seeded(SHAPE, 0)
    mine = whole.chunk(ctx.world, dim=1)[ctx.rank].clone().requires_grad_()
    y = GatherSequence.apply(mine, ctx.group)
    what, reference = "GatherSequence.forward", "the whole sequence"
    assert_matches(y, whole, what, rtol=0, atol=0, reference=reference)
    grads = [seeded(SHAPE, 10 + r) for r in range(ctx.world)]
    y.backward(grads[ctx.rank])
    want = sum(grads).chunk(ctx.world, dim=1)[ctx.rank]
    what = "GatherSequence.backward: the gradient of this rank's tokens"
    reference = "their rows of the sum of every rank's gradient"
    assert_matches(mine.grad, want, what, rtol=1e-6, atol=1e-6, reference=reference)


def check_g(ctx):
    """ScatterSequence, g: forward, this rank's tokens of the sum of the ranks' partial results;
    backward, every rank's partial result took part in every token: its gradient is every rank's
    gradient of its tokens, side by side."""
    from sequence_parallel import ScatterSequence

    parts = [seeded(SHAPE, r) for r in range(ctx.world)]
    mine = parts[ctx.rank].clone().requires_grad_()
    y = ScatterSequence.apply(mine, ctx.group)
    want = sum(parts).chunk(ctx.world, dim=1)[ctx.rank]
    what, reference = "ScatterSequence.forward", "this rank's tokens of the ranks' sum"
    assert_matches(y, want, what, rtol=1e-6, atol=1e-6, reference=reference)
    B, T, D = SHAPE
    grads = [seeded((B, T // ctx.world, D), 10 + r) for r in range(ctx.world)]
    y.backward(grads[ctx.rank])
    what = "ScatterSequence.backward: the partial result's gradient"
    reference = "every rank's gradient of its tokens, side by side"
    assert_matches(mine.grad, torch.cat(grads, dim=1), what, rtol=0, atol=0, reference=reference)


def check_norm(ctx):
    """norm_forward: the RMSNorm of this rank's tokens, and its weight's gradient summed over tp
    (each rank saw its tokens only): those of one process on the whole sequence; the norm's
    weight is its parameter again after the call, and after a call that failed."""
    from model import RMSNorm
    from sequence_parallel import norm_forward

    B, T, D = SHAPE
    reference, norm = RMSNorm(D, 1e-5), RMSNorm(D, 1e-5)
    with torch.no_grad():
        reference.weight.copy_(seeded(D, 1))
        norm.weight.copy_(reference.weight)
    norm.tp_group, weight = ctx.group, norm.weight
    x, grad = seeded(SHAPE, 2), seeded(SHAPE, 3)
    mine = lambda t: t.chunk(ctx.world, dim=1)[ctx.rank]  # noqa: E731
    y = norm_forward(norm, mine(x))
    want = reference(x)
    what, reference_name = "norm_forward: the output", "one process's, this rank's tokens"
    assert_matches(y, mine(want), what, rtol=1e-6, atol=1e-6, reference=reference_name)
    y.backward(mine(grad))
    want.backward(grad)
    what = "norm_forward: the weight's gradient"
    assert norm.weight.grad is not None, f"{what} is None"
    want, reference_name = reference.weight.grad, "one process's, on the whole sequence"
    assert_matches(norm.weight.grad, want, what, rtol=1e-5, atol=1e-6, reference=reference_name)
    assert norm._parameters["weight"] is weight, (
        "norm_forward: after the call, the norm's weight is not its parameter: put it back"
    )
    with pytest.raises(RuntimeError):  # a hidden size that is not the norm's
        norm_forward(norm, seeded((B, T // ctx.world, D + 1), 4))
    assert norm._parameters["weight"] is weight, (
        "norm_forward: after a call that failed, the norm's weight is not its parameter: put it "
        "back whatever happens (try, finally)"
    )


def check_model(ctx):
    """apply_sequence_parallel, set_sequence_parallel: the model at tp 2, built as train.py builds
    it with --sequence_parallel (recomputation aside), has the sequence's f and g, plain tensor
    parallelism's within whole_sequence_per_tp_rank (sampling) and the sequence's again after;
    its loss is one process's to 1e-6 and every gradient to 1e-5 of that parameter's largest."""
    import train

    from model import RMSNorm
    from placement import piece, placed_parameters
    from process_group_manager import ProcessGroupManager
    from sequence_parallel import GatherSequence, ScatterSequence, whole_sequence_per_tp_rank
    from tensor_parallel import Copy, Reduce, RowParallelLinear, VocabParallelEmbedding

    args = train.parse_args([*TINY, "--tp_size", str(ctx.world), "--sequence_parallel"])
    pgm = ProcessGroupManager(ctx.world, 1, 1, 1)
    config = train.load_config(args)
    with torch.device("meta"):
        model = train.LlamaForCausalLM(config)
        train.apply_tensor_parallel(model, pgm.tp_group)
        train.apply_sequence_parallel(model)
        train.keep_stage(model, pgm)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(args.seed)

    def check_swapped(on, when):
        f, g = (GatherSequence, ScatterSequence) if on else (Copy, Reduce)
        for name, module in model.named_modules():
            if isinstance(module, RMSNorm):
                assert vars(module).get("f") is f, (
                    f"set_sequence_parallel: {when}, {name}.f is {vars(module).get('f')}, not "
                    f"{f.__name__}"
                )
            if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
                assert vars(module).get("g") is g, (
                    f"set_sequence_parallel: {when}, {name}.g is {vars(module).get('g')}, not "
                    f"{g.__name__}"
                )

    check_swapped(True, "under sequence parallelism")
    with whole_sequence_per_tp_rank(model):
        check_swapped(False, "within whole_sequence_per_tp_rank")
    check_swapped(True, "after whole_sequence_per_tp_rank")
    code = "the model under apply_sequence_parallel (set_sequence_parallel, norm_forward)"
    reference = dense(config, args.seed)
    inputs, targets = batch(config)
    want = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
    want.backward()
    loss = train.loss_fn(train.PipelineParallel(model)(inputs), targets, pgm)
    loss.backward()
    what = f"{code}: the loss"
    assert_matches(loss, want, what, rtol=0, atol=1e-6, reference="one process")
    grads = dict(reference.named_parameters())
    for placed in placed_parameters(model):
        expected = piece(grads[placed.name].grad, placed.record)
        what = f"{code}: {placed.name}.grad"
        assert placed.param.grad is not None, f"{what} is None"
        atol = 1e-5 * expected.abs().max().item()
        assert_matches(
            placed.param.grad, expected, what, rtol=0, atol=atol, reference="one process"
        )


def check_apply_recompute(ctx):
    """apply_recompute: at tp 2 with sequence parallelism, selective and full recomputation give
    the loss and every gradient of none bit for bit; a layer keeps less for backward under
    selective than under none (attention's output and log-sum-exp), and less again under full
    (its input alone)."""
    import train

    from placement import placed_parameters

    found = {}
    for mode in ["none", "selective", "full"]:
        model, config, pgm = build(ctx.world, True, mode)
        x = seeded((2, 32 // ctx.world, config.hidden_size), 5).requires_grad_()  # this rank's
        with SavedTensors(model.parameters()) as saved:
            y = model.model.layers["0"](x)
            kept = saved.live
        del y  # and what it kept
        inputs, targets = batch(config)
        loss = train.loss_fn(train.PipelineParallel(model)(inputs), targets, pgm)
        loss.backward()
        grads = {placed.name: placed.param.grad for placed in placed_parameters(model)}
        found[mode] = loss, grads, kept
    loss, grads, _ = found["none"]
    for mode in ["selective", "full"]:
        what = f"apply_recompute({mode!r})"
        assert torch.equal(found[mode][0], loss), f"{what}: the loss is not none's"
        for name, grad in found[mode][1].items():
            assert torch.equal(grad, grads[name]), f"{what}: {name}.grad is not none's, bit for bit"
    kept = {mode: found[mode][2] for mode in found}
    assert kept["none"] > kept["selective"] > kept["full"], (
        f"apply_recompute: a layer keeps {kept} bytes for backward in each mode: selective keeps "
        "less than none, full less again"
    )


PIECES = {
    "gather_sequence": check_gather_sequence,
    "reduce_scatter_sequence": check_reduce_scatter_sequence,
    "f": check_f,
    "g": check_g,
    "norm": check_norm,
    "model": check_model,
    "apply_recompute": check_apply_recompute,
}


def piece_worker(rank, world, piece):
    alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    ctx = SimpleNamespace(rank=rank, world=world, group=dist.group.WORLD, alone=alone[rank])
    PIECES[piece](ctx)


@pytest.mark.parametrize("piece", list(PIECES))
@pytest.mark.parametrize("step", CARRIERS, **STEP_IDS)
def test_piece_matches_one_process(tmp_path, step, piece):
    """One piece of sequence parallelism or recomputation at a time, on 2 ranks: the graded steps
    of the exercise (tools/steps.py), in step 13 and every later step's copy."""
    spawn(step, piece_worker, 2, tmp_path, piece)


@pytest.mark.parametrize("step", CARRIERS, **STEP_IDS)
def test_recompute_runs_the_function_again_in_backward(step):
    """recompute: the output and gradients of the plain call, bit for bit; autograd keeps the
    inputs alone for backward, and backward runs the function once more."""
    recompute = import_step(step, "recompute")
    calls = []

    def function(x, w):
        calls.append(x.shape)
        return torch.tanh(x @ w).exp() @ w.T  # keeps x, w, and tanh's and exp's outputs

    x0, w0 = seeded((4, 8), 0), seeded((8, 16), 1)
    found = {}
    for name, call in [("plain", function), ("recompute", partial(recompute.recompute, function))]:
        calls.clear()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with SavedTensors([]) as saved:
            y = call(x, w)
            kept = saved.live
        forwards = len(calls)
        y.square().sum().backward()
        found[name] = (y.detach(), x.grad, w.grad), kept, (forwards, len(calls) - forwards)
    names = ["output", "x.grad", "w.grad"]
    for what, got, want in zip(names, found["recompute"][0], found["plain"][0], strict=True):
        assert_matches(got, want, f"recompute: {what}", rtol=0, atol=0, reference="the plain call")
    inputs, kept, plain = 4 * (x0.numel() + w0.numel()), found["recompute"][1], found["plain"][1]
    assert kept == inputs, (
        f"recompute: {kept} bytes kept for backward, the inputs' are {inputs} (the plain call "
        f"keeps {plain}): keep the inputs alone"
    )
    runs = found["recompute"][2]
    assert runs == (1, 1), (
        f"recompute: the function ran {runs[0]} times in forward and {runs[1]} in backward: once "
        "each"
    )


@pytest.mark.parametrize("step", CARRIERS, **STEP_IDS)
def test_recompute_attention_keeps_q_k_v_alone(step):
    """RecomputeAttention: within it, causal grouped-query attention (is_causal and enable_gqa
    passed on) gives the plain call's output and gradients bit for bit, and keeps q, k, v alone
    for backward, not its output and log-sum-exp; any other function runs as it is."""
    recompute = import_step(step, "recompute")
    q0, k0, v0 = seeded((2, 4, 16, 8), 0), seeded((2, 2, 16, 8), 1), seeded((2, 2, 16, 8), 2)
    w0 = seeded((8, 3), 3)
    found = {}
    for name, mode in [("plain", nullcontext()), ("within", recompute.RecomputeAttention())]:
        q, k, v, w = (t.clone().requires_grad_() for t in (q0, k0, v0, w0))
        try:
            with SavedTensors([]) as saved, mode:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError as error:  # 4 query heads, 2 key/value heads: enable_gqa lost?
            raise AssertionError(f"RecomputeAttention.__torch_function__: {error}") from None
        with SavedTensors([]) as other, mode:
            z = q @ w  # another function: as it is
        (y.square().sum() + z.square().sum()).backward()
        outputs = y.detach(), z.detach(), q.grad, k.grad, v.grad, w.grad
        found[name] = outputs, saved.peak, other.peak
    names = ["attention's output", "q @ w", "q.grad", "k.grad", "v.grad", "w.grad"]
    for what, got, want in zip(names, found["within"][0], found["plain"][0], strict=True):
        what = f"RecomputeAttention.__torch_function__: {what}"
        assert_matches(got, want, what, rtol=0, atol=0, reference="the plain call")
    qkv = 4 * (q0.numel() + k0.numel() + v0.numel())
    kept, plain = found["within"][1], found["plain"][1]
    assert kept == qkv < plain, (
        f"RecomputeAttention.__torch_function__: attention keeps {kept} bytes for backward, q, k, "
        f"v are {qkv} (the plain call keeps {plain}): keep q, k, v alone"
    )
    assert found["within"][2] == found["plain"][2], (
        f"RecomputeAttention.__torch_function__: q @ w keeps {found['within'][2]} bytes, the plain "
        f"call {found['plain'][2]}: any other function runs as it is"
    )


# ---- the model against one process, and PyTorch's own plan -------------------------------------


def against_one_process(rank, world, results):
    """Each layout's loss, the worst gradient off one process's (its largest difference over the
    largest value of that parameter's gradient) and the tp group's communication, per kind."""
    import train

    from comm_stats import CommStats
    from placement import piece, placed_parameters

    grads = {}
    for sp, mode in LAYOUTS:
        model, config, pgm = build(world, sp, mode)
        if not grads:  # the reference: one process, the whole model
            reference = dense(config, train.parse_args(TINY).seed)
            inputs, targets = batch(config)
            logits = reference(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            want_loss = loss.item()
            want = {name: p.grad for name, p in reference.named_parameters()}
        with CommStats(pgm) as stats:
            loss = train.loss_fn(train.PipelineParallel(model)(inputs), targets, pgm)
            loss.backward()
        worst, ours = 0.0, {}
        for placed in placed_parameters(model):
            expected = piece(want[placed.name], placed.record)
            off = (placed.param.grad - expected).abs().max() / expected.abs().max()
            worst = max(worst, off.item())
            ours[placed.name] = placed.param.grad
        grads[sp, mode] = ours
        same = {name: torch.equal(g, grads[sp, "none"][name]) for name, g in ours.items()}
        comm = {kind: row["bytes"] for kind, row in stats.as_dict().get("tp", {}).items()}
        results.put((rank, sp, mode, loss.item() - want_loss, worst, all(same.values()), comm))
    results.put((rank, "shape", config.num_hidden_layers, config.hidden_size))


def test_every_layout_computes_one_process_gradients(tmp_path):
    """tp 2, fp32, one micro-batch: the loss to 1e-6 and each parameter's gradient to 1e-5 of its
    largest element (the norms' weights, summed over tp, are half off if the sum is left out);
    recomputation gives the bits of no recomputation. Communication over tp, in bytes, X = one
    (B, T, D) fp32 activation: plain tp all-reduces X at each of the 4L + 2 places (g forward
    after o_proj, down_proj and the embedding; f backward at the 2L + 1 norms); sequence
    parallelism reduce-scatters and all-gathers X at each instead, and all-reduces the 2L + 1
    norms' weight gradients, D floats each; the loss's all-reduces are the same. Full
    recomputation runs each layer's forward again, its 2 f's (all-gathers with sequence
    parallelism) and its first g: torch's checkpoint stops the forward once it has every tensor
    backward needs, and nothing keeps down_proj's output (the residual add saves nothing)."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(S13, against_one_process, 2, tmp_path, results)
    found, shape = {}, {}
    while not results.empty():
        item = results.get()
        if item[1] == "shape":
            shape[item[0]] = item[2:]
            continue
        rank, sp, mode, loss_off, worst, same, comm = item
        found[rank, sp, mode] = loss_off, worst, same, comm
    print(found)
    assert len(found) == 2 * len(LAYOUTS)
    L, D = shape[0]
    X = 2 * 32 * D * 4
    for (rank, sp, mode), (loss_off, worst, same, _) in found.items():
        assert abs(loss_off) < 1e-6 and worst < 1e-5, (rank, sp, mode, loss_off, worst)
        assert same, (rank, sp, mode)
    for rank in [0, 1]:
        plain, sp = found[rank, False, "none"][3], found[rank, True, "none"][3]
        norms = (2 * L + 1) * D * 4
        loss_bytes = sp["all-reduce"] - norms
        assert plain["all-reduce"] - loss_bytes == (4 * L + 2) * X
        assert sp["reduce-scatter"] == sp["all-gather"] == (4 * L + 2) * X
        assert found[rank, True, "selective"][3] == sp
        full = found[rank, True, "full"][3]
        assert full["all-reduce"] == sp["all-reduce"]
        assert full["reduce-scatter"] - sp["reduce-scatter"] == L * X
        assert full["all-gather"] - sp["all-gather"] == 2 * L * X
        plain_full = found[rank, False, "full"][3]
        assert plain_full["all-reduce"] - plain["all-reduce"] == L * X


def against_dtensor(rank, world, results):
    """Step 13 at tp 2 with sequence parallelism, and the same model.py model parallelised by
    PyTorch's own plan (torchtitan's): the embedding and the row-parallel layers give Shard(1),
    the norms are `SequenceParallel`, attention and the MLP gather their input
    (`PrepareModuleInput`), q/k/v and gate/up are `ColwiseParallel`, lm_head gathers the logits."""
    import train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from placement import piece, placed_parameters

    model, config, pgm = build(world, True, "none")
    theirs = dense(config, train.parse_args(TINY).seed)
    mesh = init_device_mesh("cpu", (world,))
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    to_sequence = dict(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(
        theirs,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **to_sequence),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in theirs.model.layers:
        plan = {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
        }
        plan.update({"self_attn": gather, "mlp": gather})
        for name in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]:
            plan[name] = ColwiseParallel()
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()})
        plan["self_attn.o_proj"] = RowwiseParallel(**to_sequence)
        plan["mlp.down_proj"] = RowwiseParallel(**to_sequence)
        parallelize_module(layer, mesh, plan)
    inputs, targets = batch(config)
    logits = theirs(inputs)
    their_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    their_loss.backward()
    loss = train.loss_fn(train.PipelineParallel(model)(inputs), targets, pgm)
    loss.backward()
    want = {name: p.grad.full_tensor() for name, p in theirs.named_parameters()}
    worst = 0.0
    for placed in placed_parameters(model):
        expected = piece(want[placed.name], placed.record)
        off = (placed.param.grad - expected).abs().max() / expected.abs().max()
        worst = max(worst, off.item())
    results.put((rank, loss.item(), their_loss.item(), worst))


def test_sequence_parallel_equals_dtensor(tmp_path):
    """The loss to rounding (1e-6) and every gradient to 1e-5 of its largest element."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(S13, against_dtensor, 2, tmp_path, results)
    found = [results.get() for _ in range(2)]
    print(found)  # (rank, our loss, DTensor's, the worst gradient off)
    for rank, ours, theirs, worst in found:
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6), rank
        assert worst < 1e-5, (rank, worst)


class Tagged:
    """A queue whose items go into `queue` behind `tag`."""

    def __init__(self, queue, tag):
        self.queue, self.tag = queue, tag

    def put(self, item):
        self.queue.put((self.tag, *item))


def activation_bytes(rank, world, results):
    """tools/activation_memory.py's figures on this rank, for the fused and the math kernel, and
    its formula for the first."""
    import train

    config = train.load_config(train.parse_args(TINY))
    b, s = int(TINY[TINY.index("--micro_batch_size") + 1]), int(TINY[TINY.index("--seq_len") + 1])
    modes = [(sp, mode) for sp in [False, True] for mode in activation_memory.MODES]
    formula = {key: activation_memory.formula(config, b, s, world, *key) for key in modes}
    for attention in ["fused", "math"]:
        args = activation_memory.parse_args([*TINY, "--repeats", "1", "--attention", attention])
        activation_memory.measure(rank, world, args, Tagged(results, attention))
    results.put(("formula", rank, formula))


@pytest.mark.parametrize("step", CARRIERS, **STEP_IDS)
def test_activation_bytes_follow_the_formula(tmp_path, step):
    """tp 2, each rank, the fused kernel: one layer's bytes kept for backward are the formula's
    in every mode, with and without sequence parallelism; a micro-batch keeps less with sequence
    parallelism and with each recompute mode. The unfused kernel keeps more (the scores), and
    selective recomputation drops them: it keeps what it keeps with the fused one. The peak of a
    step is above what its forward keeps, and falls with full recomputation."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(step, activation_bytes, 2, tmp_path, results)
    found = {}
    while not results.empty():
        attention, rank, figures = results.get()
        found[attention, rank] = figures
    print(found)
    assert len(found) == 6
    for rank in [0, 1]:
        fused, math, formula = (found[kind, rank] for kind in ["fused", "math", "formula"])
        assert sorted(fused) == sorted(formula)
        for key, (layer, _, _, _) in fused.items():
            assert layer == formula[key], key
        for sp in [False, True]:
            batch = [fused[sp, mode][1] for mode in ["none", "selective", "full"]]
            assert batch[0] > batch[1] > batch[2], (sp, batch)
            assert math[sp, "none"][0] > fused[sp, "none"][0]
            assert math[sp, "selective"][:2] == fused[sp, "selective"][:2]
        assert fused[True, "none"][1] < fused[False, "none"][1]
        # The peak of a step holds what the forward saved, and more: the weights, the gradients,
        # backward's temporaries. Full recomputation lowers it by about what it does not save
        # (gloo's own buffers move a peak by a few percent from rank to rank).
        for (sp, mode), (_, batch, _, peak) in fused.items():
            assert peak > batch, (sp, mode, peak, batch)
        for sp in [False, True]:
            (_, kept, _, peak), (_, kept_full, _, peak_full) = fused[sp, "none"], fused[sp, "full"]
            assert peak - peak_full > (kept - kept_full) / 2, (sp, fused)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sequence_parallel"], "--sequence_parallel cuts the sequence over the tp ranks, here"),
        (
            ["--tp_size", "2", "--sequence_parallel", "--seq_len", "33"],
            "--seq_len 33 into tp_size x cp_size = 2 x 1 = 2 equal pieces",
        ),
        (["--recompute", "some"], "argument --recompute: invalid choice: 'some'"),
        (["--recompute", "selective", "--cp_size", "2"], "with --cp_size 2 attention is the ring"),
    ],
    ids=["no-tp", "seq-len", "mode", "selective-cp"],
)
def test_what_cannot_work_is_refused_before_the_first_step(flags, message, capsys, monkeypatch):
    assert_refused(S13, [*TINY, "--max_steps", "2", *flags], 1, message, capsys, monkeypatch)


# zero3_dp2_pp2_full: ZeRO-3's views of the whole weights, made again in backward for the
# recomputed forward, carry grad mode (backward's hooks run without it).
TRAINED = ["sp_cp2_tp2", "sp_dp2_tp2_zero3_full", "sp_pp2_tp2_full", "sp_tp2_selective"]
TRAINED += ["zero3_dp2_pp2_full"]


class Trained(dict):
    """Step 3 on one process ("baseline") and the manifest's step-13 layouts, each trained the
    first time a test asks for it (a grade of the exercise trains the baseline and one layout).
    Step 13 runs from the folder that --step names."""

    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir
        self.layouts = {layout.name: layout for layout in convergence.step_layouts(13, 2)}
        self.layouts["baseline"] = convergence.baseline_layout(2)

    def __missing__(self, name):
        common = [*TINY, "--max_steps", "8", "--eval_every", "4", "--eval_steps", "2"]
        common += ["--num_proc", "1", "--sample_tokens", "4"]
        env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        layout = replace(self.layouts[name], step=str(step_dir(self.layouts[name].step)))
        self[name] = convergence.run(layout, common, self.out_dir, env=env)
        return self[name]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return Trained(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("name", TRAINED)
def test_every_layout_trains_like_one_process(trained, name):
    """The manifest's step-13 layouts (sequence parallelism at tp 2 with selective recomputation;
    tp 2 x pp 2 with 1F1B and full; tp 2 x cp 2; dp 2 x tp 2 at ZeRO-3 with full; dp 2 x pp 2 at
    ZeRO-3 with full) against step 3 on one process, accumulating the same batch."""
    assert sorted(trained.layouts) == sorted(["baseline", *TRAINED])
    comparison = convergence.compare(trained[name], trained["baseline"])
    print(f"\n{convergence.table({name: comparison})}")
    assert comparison.ok, f"{name}: {comparison.problems}"
