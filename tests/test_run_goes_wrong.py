"""A run that goes wrong says so at once and keeps what is good: a step whose loss or gradient
norm is not finite on any rank is never applied (it stops the run, or is skipped on every rank),
a rank that stalls stops the job after --dist_timeout_s with one message, a checkpoint that would
not fit on the disk is refused before it is begun, old checkpoints go with --keep_last, and
torchrun's restarts are warned about when they could not reconnect.

The faults are injected by a launcher that patches one rank's code before train.main() runs.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import LAUNCH, ROOT, TINY, check, import_step, read_log, run_step, step_dir

S3, S5, S9 = "step3_dataloader", "step5_data_parallel_naive", "step9_3d_parallel"
RUN = [*TINY, "--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "1", "--eval_every", "0"]

LAUNCHER = """import sys
from pathlib import Path

step = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(step))  # the step's modules
sys.argv = [str(step / "train.py"), *sys.argv[2:]]
import torch.distributed as dist
import train
import utils
{patch}
utils.run_main(train.main)
"""
# One rank's gradient gets an inf at the given steps, after the data-parallel average and
# before the norm: only that rank sees it.
INF_GRADIENT = """
calls, correct = [0], train.clip_grad_norm

def clip_grad_norm(gradients, *args, **kwargs):
    calls[0] += 1
    if calls[0] in {steps} and dist.get_rank() == {rank}:
        gradients.grads[0].view(-1)[0] = float("inf")
    return correct(gradients, *args, **kwargs)

train.clip_grad_norm = clip_grad_norm
"""
# The same in step 3, whose train_step calls torch's own clip_grad_norm_.
INF_GRADIENT_S3 = """
import torch

calls, correct = [0], torch.nn.utils.clip_grad_norm_

def clip_grad_norm_(parameters, *args, **kwargs):
    parameters = list(parameters)
    calls[0] += 1
    if calls[0] in {steps} and dist.get_rank() == {rank}:
        next(p.grad for p in parameters if p.grad is not None).view(-1)[0] = float("inf")
    return correct(parameters, *args, **kwargs)

torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
"""
# One rank stops answering at its second step, as a deadlocked or lost rank does, for longer
# than the collective timeout; then it leaves without a word.
STALL = """
import os
import time

calls, correct = [0], train.train_step

def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 2 and dist.get_rank() == {rank}:
        time.sleep({seconds})
        os._exit(0)
    return correct(*args, **kwargs)

train.train_step = train_step
"""


def launch(tmp_path, step, patch, args, nproc):
    launcher = tmp_path / f"launch_{time.monotonic_ns()}.py"
    launcher.write_text(LAUNCHER.format(patch=patch))
    command = [*LAUNCH, f"--nproc_per_node={nproc}", str(launcher), str(step_dir(step)), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def errors(result):
    return [line for line in (result.stdout + result.stderr).splitlines() if "error: " in line]


def test_a_nonfinite_gradient_on_one_rank_stops_every_rank_at_tp2_pp2(tmp_path):
    """Rank 3 alone (pp stage 1, tp rank 1) sees an inf at step 3: every rank stops there, before
    the update, with one message; the step 2 checkpoint stays the latest, step 3 is not saved,
    not validated, and no sample is drawn from it."""
    save_dir, log_file = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = [*RUN, "--tp_size", "2", "--pp_size", "2", "--max_steps", "5", "--save_every", "1"]
    args += ["--save_dir", str(save_dir), "--log_file", str(log_file)]
    result = launch(tmp_path, S9, INF_GRADIENT.format(steps=[3], rank=3), args, nproc=4)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert len(errors(result)) == 1, output
    assert "error: step 3: the gradient norm is not finite on some rank" in output
    assert f"the last checkpoint, {save_dir / 'step_000002'}, is as it was" in output
    assert (save_dir / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in save_dir.glob("step_*")) == ["step_000001", "step_000002"]
    assert "validation loss" not in output and "sample:" not in output
    records = read_log(log_file)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["skipped"] is True


def test_skip_trains_on_exactly_as_a_run_without_that_batch(tmp_path):
    """dp 2, rank 1 alone sees an inf at step 2, --on_nonfinite skip: no rank applies step 2,
    and steps 3 and 4 equal steps 2 and 3 of a run that never saw that batch (the same run saved
    after step 1, its data position moved past one global batch, resumed)."""
    log_file = tmp_path / "skip.jsonl"
    args = [*RUN, "--dp_size", "2", "--max_steps", "4", "--log_file", str(log_file)]
    args += ["--on_nonfinite", "skip"]
    result = launch(tmp_path, S9, INF_GRADIENT.format(steps=[2], rank=1), args, nproc=2)
    check(result)
    assert "step 2: the gradient norm is not finite on some rank; its update is skipped" in (
        result.stdout
    )
    skipped = read_log(log_file)
    assert [r.get("skipped", False) for r in skipped] == [False, True, False, False]
    assert skipped[-1]["skipped_steps"] == 1

    save_dir = tmp_path / "ckpt"
    common = [*RUN, "--dp_size", "2", "--save_dir", str(save_dir)]
    check(run_step(S9, [*common, "--max_steps", "1"], nproc=2))
    state_file = save_dir / "step_000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["data"]["position"] += 2 * 2  # micro_batch_size x dp_size rows: step 2's batch
    torch.save(state, state_file)
    without = tmp_path / "without.jsonl"
    args = [*common, "--max_steps", "3", "--resume", "--log_file", str(without)]
    check(run_step(S9, args, nproc=2))
    expected = read_log(without)
    assert [r["step"] for r in expected] == [2, 3]
    for got, want in zip(skipped[2:], expected, strict=True):
        for key in ["loss", "grad_norm", "lr", "tokens"]:
            assert got[key] == want[key], (got["step"], key, got[key], want[key])


def test_skipping_stops_after_too_many_in_a_row(tmp_path):
    args = [*RUN, "--max_steps", "5", "--on_nonfinite", "skip", "--max_nonfinite_skips", "1"]
    result = launch(tmp_path, S3, INF_GRADIENT_S3.format(steps=[2, 3], rank=0), args, nproc=1)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "step 2: the gradient norm is not finite on some rank; its update is skipped" in output
    assert "error: step 3: the gradient norm (2 steps in a row) is not finite" in output


def test_a_stalled_rank_stops_the_job_with_one_message(tmp_path):
    """Rank 1 stops answering at step 2: rank 0's collective times out after --dist_timeout_s,
    one message names the rank, the file and the line where it waited, and the job ends."""
    args = [*RUN, "--dp_size", "2", "--max_steps", "4", "--dist_timeout_s", "4"]
    start = time.monotonic()
    result = launch(tmp_path, S5, STALL.format(rank=1, seconds=25), args, nproc=2)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert len(errors(result)) == 1, output
    (line,) = errors(result)
    assert "error: rank 0 waited --dist_timeout_s for a collective that did not complete" in line
    assert ".py:" in line and "Timed out waiting 4000ms" in line, line
    assert "Traceback" not in output, output
    assert elapsed < 60


def test_restarts_that_cannot_reconnect_are_warned_about(capsys):
    """Only across nodes: on one node each try's keys have a prefix of their own."""
    bookkeeping = import_step(S3, "bookkeeping")
    one_node = {"TORCHELASTIC_MAX_RESTARTS": "3", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8"}
    for several in [{"WORLD_SIZE": "16"}, {"GROUP_WORLD_SIZE": "2"}]:
        bookkeeping.check_restarts({**one_node, **several})
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().out, several
    for environ in [
        {**one_node, "WORLD_SIZE": "16", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        {**one_node, "WORLD_SIZE": "16", "TORCHELASTIC_MAX_RESTARTS": "0"},
        one_node,
        {},
    ]:
        bookkeeping.check_restarts(environ)
        assert capsys.readouterr().out == "", environ


def test_keep_last_keeps_the_newest_and_never_latest(tmp_path):
    retention = import_step(S3, "retention")
    save_dir = tmp_path / "ckpt"
    for step in [1, 2, 3, 4]:
        (save_dir / f"step_{step:06d}").mkdir(parents=True)
        (save_dir / f"step_{step:06d}" / "model.safetensors").write_text("w")
    (save_dir / ".step_000005.tmp").mkdir()  # being written
    (save_dir / ".step_000000.deleting").mkdir()  # left by a crash during a deletion
    (save_dir / "latest").write_text("step_000002")  # a resume from an older one
    retention.prune_checkpoints(save_dir, 1)
    names = sorted(p.name for p in save_dir.iterdir())
    assert names == [".step_000005.tmp", "latest", "step_000002", "step_000004"]


def test_keep_last_in_a_run(tmp_path):
    save_dir = tmp_path / "ckpt"
    args = [*RUN, "--max_steps", "4", "--save_dir", str(save_dir), "--save_every", "1"]
    check(run_step(S3, [*args, "--keep_last", "2"]))
    names = sorted(p.name for p in save_dir.iterdir())
    assert names == ["latest", "run.yaml", "step_000003", "step_000004"]


@pytest.mark.parametrize("mode", ["stop", "skip_save"])
def test_a_checkpoint_that_would_not_fit_is_refused_before_the_first_step(
    tmp_path, capsys, monkeypatch, mode
):
    train = import_step(S3, "train")
    retention, utils = sys.modules["retention"], sys.modules["utils"]
    free = retention.shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(retention.shutil, "disk_usage", lambda path: free)
    monkeypatch.setattr(utils.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    save_dir, data = tmp_path / "ckpt", tmp_path / "stories"
    data.mkdir()
    lines = (ROOT / "assets/datasets/tinytales/train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (data / "validation.jsonl").write_text("\n".join(lines[40:45]) + "\n")
    args = [*RUN, "--max_steps", "2", "--save_dir", str(save_dir), "--low_disk", mode]
    args += ["--dataset_name", str(data)]
    code = 0
    try:
        utils.run_main(lambda: train.main(args))
    except SystemExit as exit_info:
        code = exit_info.code
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    output = capsys.readouterr()
    output = output.out + output.err
    # 336,192 parameters, fp32, and AdamW's two moments of each
    assert "a checkpoint of step 1 needs about 4,034,304 bytes" in output, output
    assert "has 1,000 free" in output
    if mode == "stop":
        assert code == 2 and "step 1/2" not in output
    else:
        assert code == 0 and "step 2/2" in output and "not saved (--low_disk skip_save)" in output
        assert not list(save_dir.glob("step_*"))
