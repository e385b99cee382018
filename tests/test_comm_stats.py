"""The communication ledger (comm_stats.py, from step 3 on): what it counts for each kind of
call, and one training step of each layout against the formulas of the lessons, so that a layout
that starts to send more (an extra all-reduce, a gradient synchronised twice) fails here.

All in fp32 on 2 gloo ranks, B x T x D = 2 x 16 x 32, 2 layers. "sent" is what a rank sends under
the ring algorithms: 2 (n-1)/n of an all-reduce, (n-1)/n of a reduce-scatter or all-gather (of the
full tensor), all of a send.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from conftest import spawn

B, T, D, L, V = 2, 16, 32, 2, 64
H, K = 4, 2  # query heads, key/value heads; head dim D / H = 8
FP32 = 4
BTD = B * T * D * FP32  # the bytes of one (B, T, D) activation


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=K,
    )  # fmt: skip


def micro_batches(m, seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (m, B, T + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def build(pgm, cp=False, stage=False):
    """The model as the steps' train.py build it: tensor-parallel layers (over a tp group of one
    rank at tp 1), ring attention with `cp`, with `stage` this pipeline stage's layers."""
    from model import LlamaForCausalLM
    from tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = apply_tensor_parallel(LlamaForCausalLM(config()), pgm.tp_group)
        if cp:
            from context_parallel import apply_context_parallel

            apply_context_parallel(model, pgm.cp_group)
        if stage:
            from pipeline_parallel import keep_stage

            keep_stage(model, pgm)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return model


def row(calls, size, fraction):
    return {"calls": calls, "bytes": size, "sent": round(size * fraction)}


def ring_all_reduce(n):
    return 2 * (n - 1) / n


def ring_shard(n):  # reduce-scatter, all-gather
    return (n - 1) / n


def sends_only_on(stats, allowed):
    """Every (group, kind) outside `allowed` sends nothing (groups of one rank, receives)."""
    for group, kinds in stats.as_dict().items():
        for kind, counts in kinds.items():
            if (group, kind) not in allowed:
                assert counts["sent"] == 0, (group, kind, counts)


def grad_bytes(model):
    return FP32 * sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---- the ledger itself ------------------------------------------------------------------------


def ledger_checks(rank, world):
    from comm_stats import CommStats
    from process_group_manager import ProcessGroupManager

    pgm = ProcessGroupManager(tp_size=1, pp_size=1, dp_size=world)  # dp 2, tp and pp of one
    originals = {name: getattr(dist, name) for name in ["all_reduce", "isend", "P2POp"]}
    peer = 1 - rank
    x = torch.full((3, 5), float(rank + 1))  # 60 bytes
    with CommStats(pgm) as outer:
        with CommStats(pgm) as inner:
            dist.all_reduce(x)  # the default group: "world"
        dist.all_reduce(x, group=pgm.tp_group)  # one rank: listed, sends nothing
        parts = [torch.empty(3, 5) for _ in range(world)]
        dist.all_gather(parts, x, group=pgm.dp_group)
        whole = torch.empty(world * 15)
        dist.all_gather_into_tensor(whole, x.view(-1), group=pgm.dp_group)
        shard = torch.empty(15)
        dist.reduce_scatter_tensor(shard, whole, group=pgm.dp_group)
        dist.broadcast(x, src=0, group=pgm.dp_group)
        got = torch.empty(7)
        if rank == 0:  # by global rank: the dp group joins the two ranks
            dist.send(torch.ones(7), dst=peer)
        else:
            dist.recv(got, src=peer)
        ops = [dist.P2POp(dist.isend, torch.ones(2, 4), peer)]
        ops.append(dist.P2POp(dist.irecv, torch.empty(2, 4), peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if rank == 0:  # on the dp group itself
            dist.isend(torch.ones(7), dst=peer, group=pgm.dp_group).wait()
        else:
            dist.irecv(got, src=peer, group=pgm.dp_group).wait()
    # Numbers unchanged: the calls did what they do without the ledger.
    assert torch.equal(x, torch.full((3, 5), 3.0)) and torch.equal(shard, torch.full((15,), 6.0))
    assert all(torch.equal(p, torch.full((3, 5), 3.0)) for p in parts)
    assert rank == 0 or torch.equal(got, torch.ones(7))
    assert {name: getattr(dist, name) for name in originals} == originals  # back on exit
    assert inner.as_dict() == {"world": {"all-reduce": row(1, 60, 1)}}
    # Rank 0 sends 7 floats twice and 2 x 4 in the batch, and receives 2 x 4; rank 1 the other way.
    three, one = (3, 28 + 32 + 28), (1, 32)
    sent, received = (three, one) if rank == 0 else (one, three)
    p2p = {"send": row(*sent, 1), "recv": row(*received, 0)}
    assert outer.as_dict() == {
        "world": {"all-reduce": row(1, 60, 1)},
        "tp": {"all-reduce": row(1, 60, 0)},
        "dp": {
            "all-gather": row(2, 120 + 120, 0.5),  # the full tensor: both ranks' 60 bytes
            "reduce-scatter": row(1, 120, 0.5),
            "broadcast": row(1, 60, 0.5),
            **p2p,
        },
    }
    table = outer.table()
    lines = table.splitlines()
    assert lines[0].startswith(f"rank {rank} ") and len(lines) == 2 + 7, table
    assert ["dp", "2", "all-gather", "2", "240", "120"] in [line.split() for line in lines], table

    # An exception inside puts torch.distributed back too.
    with pytest.raises(RuntimeError, match="inside"), CommStats(pgm):
        raise RuntimeError("inside")
    assert {name: getattr(dist, name) for name in originals} == originals


def test_ledger_counts_every_kind_of_call_and_puts_torch_back(tmp_path):
    spawn("step3_dataloader", ledger_checks, 2, tmp_path, timeout=60)


# ---- tensor parallelism (step 4) --------------------------------------------------------------


def tp_checks(rank, world):
    from comm_stats import CommStats
    from placement import clip_grad_norm, model_gradients
    from process_group_manager import ProcessGroupManager
    from tensor_parallel import vocab_parallel_cross_entropy

    pgm = ProcessGroupManager(tp_size=world, pp_size=1, dp_size=1)
    model = build(pgm)
    [(inputs, targets)] = micro_batches(1)
    with CommStats(pgm) as step:
        with CommStats(pgm) as forward:
            loss = vocab_parallel_cross_entropy(model(inputs), targets, pgm.tp_group)
        with CommStats(pgm) as backward:
            loss.backward()
        clip_grad_norm(model_gradients(model, ["tp"]), 1.0, pgm)
    fraction = ring_all_reduce(world)
    # Forward: the embedding's all-reduce, two per block (after attention, after the MLP), then
    # the loss's three of (B, T): the max, the sum of exponentials, the target's logit.
    want = row(1 + 2 * L + 3, (1 + 2 * L) * BTD + 3 * B * T * FP32, fraction)
    assert forward.as_dict() == {"tp": {"all-reduce": want}}, forward.table()
    # Backward: two per block (where attention's and the MLP's input fans out to the column-
    # parallel layers), one where lm_head's does.
    want = row(2 * L + 1, (2 * L + 1) * BTD, fraction)
    assert backward.as_dict() == {"tp": {"all-reduce": want}}, backward.table()
    # The step: both, and the gradient norm's sum of squares, one fp32 number.
    calls, size = 1 + 2 * L + 3 + 2 * L + 1 + 1, (4 * L + 2) * BTD + 3 * B * T * FP32 + FP32
    assert step.as_dict() == {"tp": {"all-reduce": row(calls, size, fraction)}}, step.table()


def test_tensor_parallel_makes_two_all_reduces_per_block_each_way(tmp_path):
    spawn("step4_tensor_parallel", tp_checks, 2, tmp_path, timeout=60)


# ---- data parallelism (step 6) and ZeRO-1 (step 10) -------------------------------------------


def dp_checks(rank, world):
    from comm_stats import CommStats
    from data_parallel import DataParallelBucket
    from placement import clip_grad_norm, model_gradients
    from process_group_manager import ProcessGroupManager
    from tensor_parallel import vocab_parallel_cross_entropy

    pgm = ProcessGroupManager(tp_size=1, pp_size=1, dp_size=world)
    model = build(pgm)
    wrapped = DataParallelBucket(model, pgm.dp_group, bucket_size_mb=0.02)
    optimizer = torch.optim.AdamW(model.parameters())
    batches = micro_batches(2 * world)[rank::world]  # two micro-batches on each rank
    with CommStats(pgm) as stats:
        wrapped.zero_grad()
        for i, (inputs, targets) in enumerate(batches):
            wrapped.require_backward_grad_sync = i == len(batches) - 1
            logits = wrapped(inputs)
            (vocab_parallel_cross_entropy(logits, targets, pgm.tp_group) / len(batches)).backward()
        wrapped.finish_gradient_synchronization()
        clip_grad_norm(model_gradients(wrapped, ["tp"]), 1.0, pgm)
        optimizer.step()
    # Once per step, after the last micro-batch, every gradient in one of the buckets.
    buckets = len(wrapped.bucket_manager.buckets)
    assert buckets > 1
    want = row(buckets, grad_bytes(model), ring_all_reduce(world))
    assert stats.as_dict()["dp"] == {"all-reduce": want}, stats.table()
    sends_only_on(stats, {("dp", "all-reduce")})


def test_data_parallel_all_reduces_the_gradients_once(tmp_path):
    spawn("step6_data_parallel_bucket", dp_checks, 2, tmp_path, timeout=60)


def zero_step(pgm, axes, inputs, targets, cp=False):
    """One step of steps 10-11 at pp 1: the sharded bucketed wrapper over `axes`; returns the
    ledgers of the whole step, of its forward and of its backward, and the model."""
    from comm_stats import CommStats
    from pipeline_parallel import PipelineParallel, TiedEmbeddings
    from placement import clip_grad_norm
    from tensor_parallel import vocab_parallel_cross_entropy
    from zero import DataParallelZero1

    model = build(pgm, cp=cp, stage=True)
    tied = TiedEmbeddings(model, pgm)
    wrapped = DataParallelZero1(PipelineParallel(model), pgm, axes, 0.02, tied.weight)
    optimizer = torch.optim.AdamW(wrapped.shard(list(model.parameters())))
    with CommStats(pgm) as step:
        wrapped.zero_grad()
        with CommStats(pgm) as forward:
            loss = vocab_parallel_cross_entropy(wrapped(inputs), targets, pgm.tp_group)
        with CommStats(pgm) as backward:
            loss.backward()
        wrapped.finish_gradient_synchronization()
        wrapped.sum_tied_gradients(tied)
        clip_grad_norm(wrapped.gradients(tied), 1.0, pgm)
        optimizer.step()
        wrapped.all_gather_parameters()
    buckets = len(wrapped.bucket_manager.buckets)
    assert buckets > 1
    return step, forward, backward, model, buckets


def zero_checks(rank, world):
    from process_group_manager import ProcessGroupManager

    pgm = ProcessGroupManager(tp_size=1, pp_size=1, dp_size=world)
    [(inputs, targets)] = micro_batches(world)[rank::world]
    step, _, _, model, buckets = zero_step(pgm, ("dp",), inputs, targets)
    # The tiny model's parameters have even sizes: the buckets need no padding at dp 2. Each
    # bucket is reduce-scattered, then all-gathered, each carrying every gradient once; and the
    # gradient norm's sum of squares is one number.
    size = grad_bytes(model)
    want = {
        "all-reduce": row(1, FP32, ring_all_reduce(world)),
        "reduce-scatter": row(buckets, size, ring_shard(world)),
        "all-gather": row(buckets, size, ring_shard(world)),
    }
    dp = step.as_dict()["dp"]
    assert dp == want, step.table()
    # Together: what data parallelism's all-reduce sends, 2 (dp-1)/dp of the gradients.
    sent = dp["reduce-scatter"]["sent"] + dp["all-gather"]["sent"]
    assert sent == round(size * ring_all_reduce(world))
    sends_only_on(step, {("dp", kind) for kind in dp})


def test_zero1_sends_the_bytes_of_data_parallel(tmp_path):
    spawn("step10_zero1", zero_checks, 2, tmp_path, timeout=60)


# ---- pipeline parallelism (step 8: AFAB and 1F1B) ---------------------------------------------


def pp_checks(rank, world):
    import pipeline_parallel as pp
    from comm_stats import CommStats
    from placement import clip_grad_norm, model_gradients
    from process_group_manager import ProcessGroupManager
    from tensor_parallel import vocab_parallel_cross_entropy

    pgm = ProcessGroupManager(tp_size=1, pp_size=world, dp_size=1)
    m = 3
    batches = micro_batches(m)
    loss_fn = lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, pgm.tp_group)

    def step(engine, ledger):
        stage = pp.PipelineParallel(build(pgm, stage=True))
        tied = pp.TiedEmbeddings(stage.model, pgm)
        actions = pp.SCHEDULES[engine](world, m)[rank]
        with ledger:
            pp.run_schedule(actions, [pp.Stage(stage, pgm)], batches, loss_fn, (B, T, D),
                            torch.device("cpu"), torch.float32)  # fmt: skip
            clip_grad_norm(model_gradients(stage, ("tp", "pp"), tied.counted), 1.0, pgm)
        return [p.grad for p in stage.parameters()]

    for engine in ["afab", "1f1b"]:
        stats = CommStats(pgm)
        grads = step(engine, stats)
        # The ledger changes no number: the same gradients, to the bit, as without it.
        for got, want in zip(grads, step(engine, contextlib.nullcontext()), strict=True):
            assert torch.equal(got, want)
        # One boundary: per micro-batch, its activations forward and their gradient back, each
        # (B, T, D). Stage 0 sends the activations and receives the gradients, stage 1 the
        # other way round.
        want = {
            "all-reduce": row(1, FP32, ring_all_reduce(world)),  # the stages' sums of squares
            "send": row(m, m * BTD, 1),
            "recv": row(m, m * BTD, 0),
        }
        assert stats.as_dict()["pp"] == want, (engine, stats.table())
        sends_only_on(stats, {("pp", "send"), ("pp", "all-reduce")})


def test_pipeline_passes_one_activation_and_one_gradient_per_micro_batch(tmp_path):
    spawn("step8_pipeline_parallel_1f1b", pp_checks, 2, tmp_path, timeout=60)


# ---- context parallelism (step 11) ------------------------------------------------------------


def cp_checks(rank, world):
    from context_parallel import split_sequence
    from process_group_manager import ProcessGroupManager

    pgm = ProcessGroupManager(tp_size=1, pp_size=1, dp_size=1, cp_size=world)
    [(inputs, targets)] = micro_batches(1)
    mine = [split_sequence(x, pgm.cp_rank, world) for x in (inputs, targets)]
    step, forward, backward, model, buckets = zero_step(pgm, ("dp", "cp"), *mine, cp=True)
    block = B * K * (T // world) * (D // H) * FP32  # one K or V block: (B, K, T/cp, d)
    # Forward: at each of cp-1 steps of the ring a layer passes its K and V blocks on.
    blocks = L * 2 * (world - 1)
    want = {"send": row(blocks, blocks * block, 1), "recv": row(blocks, blocks * block, 0)}
    assert forward.as_dict()["cp"] == want, forward.table()
    # Backward: the K and V blocks go around again (cp-1 steps), with their gradients, which
    # travel one step more (cp), to the rank that holds the block.
    blocks = L * (2 * (world - 1) + 2 * world)
    want = {"send": row(blocks, blocks * block, 1), "recv": row(blocks, blocks * block, 0)}
    assert backward.as_dict()["cp"] == want, backward.table()
    # The cp ranks hold the same weights: the gradients are averaged, the optimizer sharded, over
    # dp x cp, with the bytes of data parallelism.
    size, half = grad_bytes(model), ring_shard(world)
    want = {"reduce-scatter": row(buckets, size, half), "all-gather": row(buckets, size, half)}
    assert step.as_dict()["dp_cp"] == want, step.table()
    # The norm's sum of squares, over the axes of more than one rank of dp x cp: here cp alone.
    assert step.as_dict()["cp"]["all-reduce"] == row(1, FP32, ring_all_reduce(world))
    sends_only_on(step, {("cp", "send"), ("cp", "all-reduce"), *(("dp_cp", k) for k in want)})


def test_context_parallel_passes_key_value_blocks_around_the_ring(tmp_path):
    spawn("step11_context_parallel", cp_checks, 2, tmp_path, timeout=60)
