"""Step 10, ZeRO-1: the sharded update is AdamW's; training at dp 2, dp 4 and tp 2 x dp 2 x pp 2
(with tied embeddings split between the stages) gives step 9's losses and gradient norms; each
rank's optimizer state is 1/dp of the whole; the sharded state resumes exactly, and in another
dp_size and bucket size too."""

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
        norm = wrapped.clip_grad_norm(max_norm, pgm, untied)
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


# ---- training against step 9 ------------------------------------------------------------------


def train(step, tmp, name, nproc, flags, accumulation, steps=12):
    log_file = tmp / f"{name}.jsonl"
    args = [*COMMON, *flags, "--gradient_accumulation_steps", str(accumulation)]
    args += ["--max_steps", str(steps), "--log_file", str(log_file)]
    result = check(run_step(step, args, nproc=nproc))
    return args, read_log(log_file), result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Step 9 on one process, and step 10 at dp 2 (checkpoints at steps 6 and 12), dp 4 and, with
    tied embeddings (a copy on each of the two stages), tp 2 x dp 2 x pp 2 against step 9 tied on
    one process; each pair with the same global batch. dp 4 also writes its --dp_timeline."""
    tmp = tmp_path_factory.mktemp("zero1")
    grid = ["--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"]
    save = ["--save_dir", str(tmp / "ckpt"), "--save_every", "6"]
    tied = ["--model_name", str(convergence.tied_config("tiny", tmp / "tied"))]
    timeline = ["--dp_timeline", str(tmp / "dp4.json")]
    return {
        "reference": train("step9_3d_parallel", tmp, "reference", 1, [], ACCUMULATION),
        "dp2": train(STEP, tmp, "dp2", 2, ["--dp_size", "2", *save], ACCUMULATION // 2),
        "dp4": train(STEP, tmp, "dp4", 4, ["--dp_size", "4", *timeline], ACCUMULATION // 4),
        "tied_reference": train("step9_3d_parallel", tmp, "tied", 1, tied, ACCUMULATION, 6),
        "3d_tied": train(STEP, tmp, "3d", 8, [*grid, *tied], ACCUMULATION // 2, steps=6),
        "save_dir": tmp / "ckpt",
    }


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
