"""Step 10, ZeRO-1: each piece of a sharded step against one process (a bucket's shards, their
reduce-scatter, the optimizer's pieces, the all-gather, the norm); the sharded update is AdamW's;
training at dp 2, dp 4 and tp 2 x dp 2 x pp 2 (with tied embeddings split between the stages)
gives step 9's losses and gradient norms; each rank's optimizer state is 1/dp of the whole; the
sharded state resumes exactly, and in another dp_size and bucket size too."""

import itertools
import json
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ROOT,
    TINY,
    assert_matches,
    assert_same_training,
    check,
    check_overlap_trace,
    read_log,
    run_step,
    spawn,
)
from torch import nn

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

STEP = "step10_zero1"
COMMON = [*TINY, "--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "2"]
COMMON += ["--eval_every", "6", "--bucket_size_mb", "0.05"]  # several buckets, even here
ACCUMULATION = 4  # the one-process reference's; dp ranks take their share of it
STATE = re.compile(r"\[rank (\d+)\] optimizer state: ([0-9,]+) bytes")


# ---- one sharded step against torch.optim.AdamW on one process ---------------------------------


def tiny_model():
    torch.manual_seed(0)
    # 35 + 7 + 21 + 3 elements in buckets of at most 25 fp32 gradients (100 bytes): (3 + 21), 7
    # and 35, padded to 24, 9 and 36 for 3 ranks; parameters cross the shard boundaries.
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def adamw(groups):
    return torch.optim.AdamW(groups, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def decay_groups(params, pick=lambda group: group):
    return [
        {"params": pick([p for p in params if p.ndim >= 2]), "weight_decay": 0.1},
        {"params": pick([p for p in params if p.ndim < 2]), "weight_decay": 0.0},
    ]


def batches(step, micro_batches, dp_size):
    """The global batch of `step`, as dp_size ranks' micro-batches of 2 rows each."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(dp_size, micro_batches, 2, 5, generator=generator)
    y = torch.randn(dp_size, micro_batches, 2, 3, generator=generator)
    return x, y


def sharded_steps(rank, world, max_norms, results):
    from overlap_timeline import OverlapTimeline
    from placement import clip_grad_norm
    from process_group_manager import ProcessGroupManager
    from zero import DataParallelZero1, optimizer_state_bytes

    pgm = ProcessGroupManager(1, 1, world)
    reference, model = tiny_model(), tiny_model()
    timeline = OverlapTimeline()  # counts the buckets launched before backward ended
    wrapped = DataParallelZero1(model, pgm, ("dp",), bucket_size_mb=100 / 2**20, timeline=timeline)
    optimizer = adamw(decay_groups(list(model.parameters()), wrapped.shard))
    expected = adamw(decay_groups(list(reference.parameters())))
    m = 2  # micro-batches per rank
    untied = SimpleNamespace(counted=model)  # no tied copies: the norm counts every parameter
    for step, max_norm in enumerate(max_norms):
        x, y = batches(step, m, world)
        wrapped.zero_grad()
        for k in range(m):
            wrapped.require_backward_grad_sync = k == m - 1
            (F.mse_loss(wrapped(x[rank, k]), y[rank, k]) / m).backward()
        wrapped.finish_gradient_synchronization()
        assert timeline.launched_in_backward >= 1  # a reduce-scatter overlapped backward
        norm = clip_grad_norm(wrapped.gradients(untied), max_norm, pgm)
        optimizer.step()
        wrapped.all_gather_parameters()
        # The reference: the whole batch on one process, clipped by torch's own function.
        expected.zero_grad()
        F.mse_loss(reference(x.flatten(0, 2)), y.flatten(0, 2)).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        expected.step()
        assert norm.item() == pytest.approx(want.item(), rel=1e-6), step
        for got, ref in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    results.put((rank, optimizer_state_bytes(optimizer)))


def test_sharded_adamw_equals_adamw_on_one_process(tmp_path):
    """3 ranks, 2 micro-batches each, 4 steps, clipped or not: the parameters of every rank equal
    AdamW's on the whole batch within 1e-6, and the moments are split 3 ways."""
    results = torch.multiprocessing.get_context("spawn").Queue()
    spawn(STEP, sharded_steps, 3, tmp_path, [100.0, 0.05, 100.0, 0.05], results, timeout=300)
    sizes = dict(results.get(timeout=10) for _ in range(3))
    numel = sum(p.numel() for p in tiny_model().parameters())
    assert sum(sizes.values()) == 8 * numel  # every moment held once, on one rank
    assert max(sizes.values()) == 8 * (8 + 3 + 12)  # a third of each padded bucket


# ---- each piece of that step against one process: the graded steps of the exercise --------------


def layouts(wrapped, world, rank):
    """tiny_model's buckets laid out by hand: each one's parameters in backward's order (grouped
    as ShardedBucketManager groups them) and their offsets in the buffer, the buffer's size padded
    to `world` equal shards, this rank's [start, end), and `runs`: (param, its first element in
    the shard, lo, hi of the buffer) for each parameter with elements there."""
    manager, result = wrapped.bucket_manager, []
    backward = list(reversed(list(wrapped.module.parameters())))
    for b in range(len(manager.buckets)):
        params = [p for p in backward if manager.bucket_of[p] == b]
        starts = itertools.accumulate([0, *(p.numel() for p in params[:-1])])
        offsets = list(zip(params, starts, strict=True))
        shard = -(-sum(p.numel() for p in params) // world)
        start, end = rank * shard, (rank + 1) * shard
        runs = []
        for param, offset in offsets:
            inside = [i for i in range(param.numel()) if start <= offset + i < end]
            if inside:
                runs.append((param, inside[0], offset + inside[0], offset + inside[-1] + 1))
        layout = dict(params=params, offsets=offsets, size=world * shard, start=start, end=end)
        result.append(SimpleNamespace(**layout, runs=runs))
    return result


def flat_grads(reference, names, layout):
    """One process's gradients of a bucket's parameters, side by side as in its buffer, padded."""
    flat, grads = torch.zeros(layout.size), dict(reference.named_parameters())
    for param, offset in layout.offsets:
        flat[offset : offset + param.numel()] = grads[names[param]].grad.view(-1)
    return flat


def backward_on_shares(wrapped, reference, rank, world, step):
    """One micro-batch on each rank, through the wrapper; the whole batch on one process."""
    x, y = batches(step, 1, world)
    wrapped.zero_grad()
    wrapped.require_backward_grad_sync = True
    F.mse_loss(wrapped(x[rank, 0]), y[rank, 0]).backward()
    wrapped.finish_gradient_synchronization()
    F.mse_loss(reference(x.flatten(0, 2)), y.flatten(0, 2)).backward()


def check_layout(ctx):
    """ShardedBucket.__init__: the buffer holds the parameters' gradients side by side, padded to
    dp_size equal shards; grad_shard, this rank's, and each main_grad are views of it."""
    for b, (bucket, layout) in enumerate(zip(ctx.buckets, ctx.layouts, strict=True)):
        code = f"ShardedBucket.__init__, bucket {b}"
        what = f"{code} on rank {ctx.rank} of {ctx.world}"  # assert_matches names the rank itself
        for param, offset in layout.offsets:  # 1, 2, ... through each main_grad
            main_grad = getattr(param, "main_grad", None)
            assert main_grad is not None and main_grad.shape == param.shape, (
                f"{what}: {ctx.names[param]} has no main_grad of its shape"
            )
            main_grad.copy_(torch.arange(offset + 1, offset + param.numel() + 1).view_as(param))
        numel = sum(param.numel() for param in layout.params)
        want = torch.cat([torch.arange(1.0, numel + 1), torch.zeros(layout.size - numel)])
        reference = "the parameters' main_grad side by side, then zeros"
        what_buffer = f"{code}: with each main_grad written, grad_data"
        assert_matches(bucket.grad_data, want, what_buffer, rtol=0, atol=0, reference=reference)
        start, end = layout.start, layout.end
        assert (bucket.start, bucket.end) == (start, end), (
            f"{what}: this rank's shard is [{bucket.start}, {bucket.end}), expected [{start}, "
            f"{end}) of {layout.size}: {ctx.world} equal shards of the padded buffer"
        )
        what_shard, reference = f"{code}: grad_shard", "the buffer's [start, end)"
        assert_matches(
            bucket.grad_shard, want[start:end], what_shard, rtol=0, atol=0, reference=reference
        )
        bucket.grad_shard.fill_(-1)  # where the reduce-scatter writes this rank's average
        assert (bucket.grad_data[start:end] == -1).all(), f"{what}: grad_shard is no view of it"
        got = [(ctx.names[param], offset) for param, offset in bucket.offsets]
        want = [(ctx.names[param], offset) for param, offset in layout.offsets]
        assert got == want, f"{what}: offsets are {got}, expected {want}"


def check_in_shard(ctx):
    for b, (bucket, layout) in enumerate(zip(ctx.buckets, ctx.layouts, strict=True)):
        got = [(ctx.names[param], *run) for param, *run in bucket.in_shard()]
        want = [(ctx.names[param], *run) for param, *run in layout.runs]
        assert got == want, (
            f"ShardedBucket.in_shard, bucket {b} on rank {ctx.rank} of {ctx.world}: it yields "
            f"{got}, expected {want}: (parameter, its first element in the shard, lo, hi of the "
            "buffer)"
        )


def check_reduce_scatter(ctx):
    """Each rank's shard of each bucket: the average of the ranks' gradients; no `.grad`."""
    backward_on_shares(ctx.wrapped, ctx.reference, ctx.rank, ctx.world, step=0)
    for b, (bucket, layout) in enumerate(zip(ctx.buckets, ctx.layouts, strict=True)):
        want = flat_grads(ctx.reference, ctx.names, layout)[layout.start : layout.end]
        what = f"ShardedBucket.sync_gradient: bucket {b}'s grad_shard"
        assert_matches(bucket.grad_shard, want, what, rtol=1e-5, atol=1e-6, reference="one process")
    for name, param in ctx.model.named_parameters():
        assert param.grad is None, (
            f"DataParallelZero1.finish_gradient_synchronization: {name} has a .grad; only this "
            "rank's shard is averaged, and the optimizer reads it through shard"
        )


def check_shard(ctx):
    """The optimizer's pieces, asked for as train.py asks (matrices, then the rest): views of the
    parameters' runs in this rank's shards, each with its run of the buffer as `.grad`."""
    params = list(ctx.model.parameters())
    buffers = [bucket.grad_data.untyped_storage().data_ptr() for bucket in ctx.buckets]
    for chosen in ([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]):
        wanted = {id(p) for p in chosen}
        want = [
            (ctx.names[param], first, b, lo, hi)
            for b, layout in enumerate(ctx.layouts)
            for param, first, lo, hi in layout.runs
            if id(param) in wanted
        ]
        got = []
        for piece in ctx.wrapped.shard(chosen):
            what = f"DataParallelZero1.shard on rank {ctx.rank}"
            storage = piece.untyped_storage().data_ptr()
            [param] = [p for p in params if p.untyped_storage().data_ptr() == storage] or [None]
            assert param is not None, f"{what}: a piece that is no view of a parameter's data"
            assert piece.is_leaf and piece.grad is not None, (
                f"{what}: a piece of {ctx.names[param]} is no leaf with a .grad (the optimizer "
                "takes leaves: a view of the parameter's data, detached)"
            )
            grad = piece.grad.untyped_storage().data_ptr()
            assert grad in buffers and piece.grad.shape == piece.shape, (
                f"{what}: the .grad of a piece of {ctx.names[param]} is no view of a bucket's "
                "buffer, of the piece's shape"
            )
            b, size = buffers.index(grad), piece.element_size()
            first = (piece.data_ptr() - param.data_ptr()) // size
            lo = (piece.grad.data_ptr() - ctx.buckets[b].grad_data.data_ptr()) // size
            got.append((ctx.names[param], first, b, lo, lo + piece.numel()))
            assert ctx.wrapped.pieces.get(param, (None,))[0] is piece, (
                f"{what}: self.pieces[{ctx.names[param]}] is not its piece (the checkpoint's "
                "optimizer state is read through it)"
            )
        assert got == want, (
            f"DataParallelZero1.shard on rank {ctx.rank}: pieces {got}, expected {want}: "
            "(parameter, its first element, bucket, lo, hi of the buffer)"
        )


def check_all_gather(ctx):
    """Each rank holds only its shards of the updated parameters (the rest is garbage): the
    all-gather gives every rank all of them."""
    updated = {name: p.detach().clone() for name, p in ctx.model.named_parameters()}
    with torch.no_grad():
        for param in ctx.model.parameters():
            param.fill_(100 + ctx.rank)
        for layout in ctx.layouts:
            for param, first, lo, hi in layout.runs:
                run = slice(first, first + hi - lo)
                param.view(-1)[run] = updated[ctx.names[param]].view(-1)[run]
    ctx.wrapped.all_gather_parameters()
    code = "DataParallelZero1.all_gather_parameters (start_all_gather, copy_parameters_out)"
    for name, param in ctx.model.named_parameters():
        what = f"{code}: {name}"
        reference = "the ranks' shards put together"
        assert_matches(param.detach(), updated[name], what, rtol=0, atol=0, reference=reference)


def check_clip(ctx):
    """The norm of the whole gradient from the ranks' shards, and the shards clipped by it."""
    backward_on_shares(ctx.wrapped, ctx.reference, ctx.rank, ctx.world, step=1)
    max_norm = 0.05
    untied = SimpleNamespace(counted=ctx.model)  # no tied copies: the norm counts every parameter
    gradients = ctx.wrapped.gradients(untied)
    norm = sys.modules["placement"].clip_grad_norm(gradients, max_norm, ctx.pgm)
    want = torch.nn.utils.clip_grad_norm_(ctx.reference.parameters(), max_norm)
    assert want > max_norm  # so that the shards are clipped
    what = "placement.clip_grad_norm of DataParallelZero1.gradients: the whole gradient's norm"
    assert_matches(norm, want, what, rtol=1e-6, atol=0, reference="one process")
    for b, (bucket, layout) in enumerate(zip(ctx.buckets, ctx.layouts, strict=True)):
        want = flat_grads(ctx.reference, ctx.names, layout)[layout.start : layout.end]
        what = f"placement.clip_grad_norm of DataParallelZero1.gradients: bucket {b}'s grad_shard"
        assert_matches(bucket.grad_shard, want, what, rtol=1e-5, atol=1e-6, reference="one process")


PIECES = {
    "layout": check_layout,
    "in_shard": check_in_shard,
    "reduce_scatter": check_reduce_scatter,
    "shard": check_shard,
    "all_gather": check_all_gather,
    "clip": check_clip,
}


def piece_worker(rank, world, piece):
    from process_group_manager import ProcessGroupManager
    from zero import DataParallelZero1

    pgm = ProcessGroupManager(1, 1, world)
    reference, model = tiny_model(), tiny_model()
    wrapped = DataParallelZero1(model, pgm, ("dp",), bucket_size_mb=100 / 2**20)
    PIECES[piece](
        SimpleNamespace(
            rank=rank,
            world=world,
            pgm=pgm,
            reference=reference,
            model=model,
            wrapped=wrapped,
            names={param: name for name, param in model.named_parameters()},
            buckets=wrapped.bucket_manager.buckets,
            layouts=layouts(wrapped, world, rank),
        )
    )


@pytest.mark.parametrize("piece", list(PIECES))
def test_piece_matches_one_process(tmp_path, piece):
    """One piece at a time, on 3 ranks (buckets padded, parameters across the shards' edges):
    the graded steps of the exercise (tools/steps.py)."""
    spawn(STEP, piece_worker, 3, tmp_path, piece)


# ---- training against step 9 ------------------------------------------------------------------


def train(step, tmp, name, nproc, flags, accumulation, steps=12):
    log_file = tmp / f"{name}.jsonl"
    args = [*COMMON, *flags, "--gradient_accumulation_steps", str(accumulation)]
    args += ["--max_steps", str(steps), "--log_file", str(log_file)]
    result = check(run_step(step, args, nproc=nproc))
    return args, read_log(log_file), result.stdout


class Runs(dict):
    """Runs made when a test first asks for them: the graded dp 2 test makes two, not five; and a
    run that fails, fails that test, not the fixture's set-up."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        self[name] = self.make[name]()
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Step 9 on one process, and step 10 at dp 2 (checkpoints at steps 6 and 12), dp 4 and, with
    tied embeddings (a copy on each of the two stages), tp 2 x dp 2 x pp 2 against step 9 tied on
    one process; each pair with the same global batch. dp 4 also writes its --dp_timeline."""
    tmp = tmp_path_factory.mktemp("zero1")
    grid = ["--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"]
    save = ["--save_dir", str(tmp / "ckpt"), "--save_every", "6"]
    tied = lambda: ["--model_name", str(convergence.tied_config("tiny", tmp / "tied"))]
    timeline = ["--dp_timeline", str(tmp / "dp4.json")]
    return Runs(
        {
            "reference": lambda: train("step9_3d_parallel", tmp, "reference", 1, [], ACCUMULATION),
            "dp2": lambda: train(STEP, tmp, "dp2", 2, ["--dp_size", "2", *save], ACCUMULATION // 2),
            "dp4": lambda: train(
                STEP, tmp, "dp4", 4, ["--dp_size", "4", *timeline], ACCUMULATION // 4
            ),
            "tied_reference": lambda: train(
                "step9_3d_parallel", tmp, "tied", 1, tied(), ACCUMULATION, 6
            ),
            "3d_tied": lambda: train(
                STEP, tmp, "3d", 8, [*grid, *tied()], ACCUMULATION // 2, steps=6
            ),
            "save_dir": lambda: tmp / "ckpt",
        }
    )


@pytest.mark.parametrize(
    "layout, reference", [("dp2", "reference"), ("dp4", "reference"), ("3d_tied", "tied_reference")]
)
def test_trains_like_step9(runs, layout, reference):
    _, records, _ = runs[layout]
    assert_same_training(records, runs[reference][1][: len(records)])


@pytest.mark.parametrize("layout", ["dp2", "dp4"])
def test_optimizer_state_falls_as_one_over_dp(runs, layout):
    """Each rank logs its bytes of AdamW moments: 8 per parameter over dp_size ranks, give or take
    the padding of its buckets (under dp_size elements each, at most one per parameter)."""
    _, records, stdout = runs[layout]
    dp = int(layout[2:])
    per_rank = {int(rank): int(size.replace(",", "")) for rank, size in STATE.findall(stdout)}
    assert sorted(per_rank) == list(range(dp))
    params = int(re.search(r"([0-9,]+) parameters per rank", stdout).group(1).replace(",", ""))
    assert sum(per_rank.values()) == 8 * params
    tensors = 21  # the 2-layer model's parameter tensors: no more buckets than that
    for size in per_rank.values():
        assert abs(size - 8 * params / dp) < 8 * dp * tensors
    assert records[0]["optimizer_state_bytes"] == per_rank[0]


def test_dp_timeline_shows_reduce_scatters_during_backward(runs):
    stdout = runs["dp4"][2]
    line = re.search(
        r"dp overlap: (\d+) buckets of at most 0.05 MB, (\d+) launched in backward", stdout
    )
    assert line and int(line[1]) > 1 and int(line[2]) >= 1, stdout[-2000:]
    trace = json.loads((runs["save_dir"].parent / "dp4.json").read_text())
    check_overlap_trace(trace, "reduce-scatter")


def test_resumes_exactly(runs, tmp_path):
    """6 steps, the checkpoint, and 6 resumed steps give the 12 steps of the straight run."""
    args, records, _ = runs["dp2"]
    save = runs["save_dir"]
    (save / "latest").write_text("step_000006")  # as if the run had died after step 6
    resumed_log = tmp_path / "resumed.jsonl"
    args = [*args[: args.index("--log_file")], "--log_file", str(resumed_log), "--resume"]
    check(run_step(STEP, args, nproc=2))
    resumed = read_log(resumed_log)
    assert [r["step"] for r in resumed] == list(range(7, 13))
    for got, want in zip(resumed, records[6:], strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
    assert resumed[-1]["val_loss"] == records[-1]["val_loss"]
    # Step 9's files: the moments were put together whole from the two dp ranks' shards.
    files = sorted(p.name for p in (save / "step_000006").glob("*.safetensors"))
    assert files == [f"{part}-pp0-of-1-tp0-of-1.safetensors" for part in ("model", "optimizer")]


def test_resumes_in_another_dp_size_and_buckets(runs, tmp_path):
    """The checkpoint of step 6 at dp 2, resumed on one process with other buckets (one shard
    holding everything, cut elsewhere): steps 7 to 12 train like the straight dp 2 run."""
    _, records, _ = runs["dp2"]
    save = tmp_path / "ckpt"
    shutil.copytree(runs["save_dir"] / "step_000006", save / "step_000006")
    (save / "latest").write_text("step_000006")
    log_file = tmp_path / "dp1.jsonl"
    args = [*COMMON, "--bucket_size_mb", "1", "--gradient_accumulation_steps", str(ACCUMULATION)]
    args += ["--max_steps", "12", "--save_dir", str(save), "--resume", "--log_file", str(log_file)]
    result = check(run_step(STEP, args, nproc=1))
    assert "saved at tp 1 x pp 1 x dp 2, running at tp 1 x pp 1 x dp 1" in result.stdout
    assert_same_training(read_log(log_file), records[6:])
