"""Each step's train.py runs end to end; step 3 resumes exactly and logs to a file and to W&B."""

import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import TINY, check, import_step, read_log, run_step

LOSS = re.compile(r"step (\d+)/\d+ \| loss ([0-9.]+)")


def losses(output):
    return {int(step): float(loss) for step, loss in LOSS.findall(output)}


@pytest.mark.parametrize("torchrun", [False, True], ids=["python", "torchrun"])
def test_step1_memorises_a_fixed_batch(torchrun):
    args = [*TINY, "--max_steps", "40", "--learning_rate", "1e-2"]
    result = check(run_step("step1_model", args, torchrun=torchrun))
    seen = losses(result.stdout)
    assert len(seen) == 40
    assert seen[1] > 7.0 and seen[40] < 0.5 * seen[1], seen


def test_step2_every_rank_trains_its_own_copy():
    args = [*TINY, "--max_steps", "3", "--dp_size", "2"]
    result = check(run_step("step2_process_group_manager", args, nproc=2))
    assert "rank 1/2: dp 1/2 pp 0/1 tp 0/1" in result.stdout
    assert len(losses(result.stdout)) == 3  # logged once, by rank 0


def step3(tmp_path, *extra, steps=20, nproc=1, env=None):
    args = [*TINY, "--max_steps", str(steps), "--eval_every", "5", "--eval_steps", "2"]
    args += ["--sample_tokens", "8", "--num_proc", "1", *extra]
    return check(run_step("step3_dataloader", args, nproc=nproc, env=env))


def test_step3_resume_gives_identical_losses(tmp_path):
    """20 steps straight, against 10 steps, a checkpoint, and a resumed run of the last 10."""
    straight = tmp_path / "straight.jsonl"
    step3(tmp_path, "--log_file", str(straight))
    save_dir = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    step3(tmp_path, "--save_dir", str(save_dir), "--save_every", "10", "--log_file", str(first))
    assert sorted(p.name for p in save_dir.iterdir()) == [
        "latest",
        "run.yaml",
        "step_000010",
        "step_000020",
    ]
    assert (save_dir / "step_000010" / "config.json").is_file()
    # Pretend the run died after step 10: its latest checkpoint is step 10.
    (save_dir / "latest").write_text("step_000010")
    resumed = tmp_path / "resumed.jsonl"
    result = step3(tmp_path, "--save_dir", str(save_dir), "--resume", "--log_file", str(resumed))
    assert "resumed from" in result.stdout and "at step 10" in result.stdout
    assert "the learning rate of step" not in result.stdout  # the same flags, the same rates
    expected, got = read_log(straight), read_log(resumed)
    assert [r["step"] for r in got] == list(range(11, 21))
    for want, have in zip(expected[10:], got, strict=True):
        for key in ["loss", "grad_norm", "lr", "tokens"]:
            assert have[key] == want[key], (have["step"], key)
    assert got[-1]["val_loss"] == expected[-1]["val_loss"]
    # Saving checkpoints does not change the run itself.
    assert [r["loss"] for r in read_log(first)] == [r["loss"] for r in expected]
    # Extended to 30 steps at twice the rate: from step 11 on, the rates of these flags' schedule.
    (save_dir / "latest").write_text("step_000010")
    flags = ["--learning_rate", "6e-3"]
    longer = tmp_path / "longer.jsonl"
    result = step3(tmp_path, "--save_dir", str(save_dir), "--resume", "--log_file", str(longer),
                   *flags, steps=30)  # fmt: skip
    train = import_step("step3_dataloader", "train")
    args = train.parse_args([*TINY, "--max_steps", "30", *flags])
    ctx = train.Context(args, torch.device("cpu"), torch.float32, pgm=None)
    _, schedule = train.build_optimizer(ctx, torch.nn.Linear(2, 2))
    rates = [6e-3 * schedule.lr_lambdas[0](step - 1) for step in range(11, 31)]
    assert [r["lr"] for r in read_log(longer)] == rates
    assert f"the learning rate of step 11 is {rates[0]:.3e}" in result.stdout
    assert f"the saved run's was {expected[10]['lr']:.3e}" in result.stdout
    # Started again once finished (its latest checkpoint, step 30, is past --max_steps 20).
    again = tmp_path / "again.jsonl"
    result = step3(tmp_path, "--save_dir", str(save_dir), "--resume", "--log_file", str(again))
    assert "step 30 is at or past the last step, 20: nothing left to train" in result.stdout
    assert not [r for r in read_log(again) if "loss" in r]


def test_a_run_file_repeats_the_command_lines_run(tmp_path):
    """The run.yaml a run writes beside its log, given to --config (with another log file on the
    command line, which overrides the file's), trains the same run to the bit."""
    flags = ["--learning_rate", "2.5e-3", "--lr_schedule", "wsd", "--seed", "7", "--dp_size", "2"]
    first = tmp_path / "first.jsonl"
    step3(tmp_path, "--log_file", str(first), *flags, steps=4, nproc=2)
    run_file = tmp_path / "first.run.yaml"
    written = yaml.safe_load(run_file.read_text())
    assert written["lr_schedule"] == "wsd" and written["learning_rate"] == 2.5e-3
    assert written["seed"] == 7 and written["log_file"] == str(first)
    again = tmp_path / "again.jsonl"
    args = ["--config", str(run_file), "--log_file", str(again)]
    check(run_step("step3_dataloader", args, nproc=2))
    assert yaml.safe_load((tmp_path / "again.run.yaml").read_text()) == {
        **written,
        "log_file": str(again),
    }
    keys = ["step", "loss", "grad_norm", "lr", "tokens", "val_loss"]
    expected = [{k: r.get(k) for k in keys} for r in read_log(first)]
    assert [{k: r.get(k) for k in keys} for r in read_log(again)] == expected
    assert len(expected) == 4 and expected[-1]["val_loss"] is not None


def test_step3_log_file_and_loss_falls(tmp_path):
    log_file = tmp_path / "log.jsonl"
    step3(tmp_path, "--log_file", str(log_file), "--learning_rate", "1e-2", steps=30)
    records = read_log(log_file)
    assert [r["step"] for r in records] == list(range(1, 31))
    for key in ["step", "loss", "grad_norm", "lr", "tokens", "tokens_per_second"]:
        assert all(key in r for r in records), key
    assert records[-1]["tokens"] == 30 * 2 * 32
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10, 15, 20, 25, 30]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0


def test_step3_wandb_offline(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    step3(tmp_path, "--use_wandb", "--run_name", "offline-test", steps=3, env=env)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), "no run data written"


def test_step3_on_two_ranks_stops_at_max_tokens(tmp_path):
    # One step is 2 rows x 32 tokens: 200 tokens allow 3 steps of the 20 asked for.
    result = step3(tmp_path, "--dp_size", "2", "--max_tokens", "200", steps=20, nproc=2)
    assert "sample:" in result.stdout
    assert sorted(losses(result.stdout)) == [1, 2, 3]


def test_the_run_reads_the_flags_and_its_questions_change_nothing(tmp_path):
    """Run never writes the flags (a resume with --max_tokens moves `run.max_steps` and the
    schedule's horizon, not args.max_steps), and its questions (`should_...`) write, prune and
    send nothing: the record is written by `log_step`, old checkpoints go in `save`."""
    import torch.distributed as dist

    train = import_step("step3_dataloader", "train")
    bookkeeping = sys.modules["bookkeeping"]
    save_dir, log_file = tmp_path / "ckpt", tmp_path / "log.jsonl"
    flags = ["--max_steps", "20", "--max_tokens", str(10 * 64), "--save_every", "1"]
    flags += ["--save_dir", str(save_dir), "--keep_last", "1", "--log_file", str(log_file)]
    args = train.parse_args([*TINY, *flags])
    given = dict(vars(args))
    assert args.max_steps == 10  # 64 tokens a step: 2 rows of 32
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = train.Context(args, torch.device("cpu"), torch.float32, pgm=None)
        optimizer, scheduler = train.build_optimizer(ctx, torch.nn.Linear(2, 2))
        run = bookkeeping.Run(args, torch.device("cpu"), 1.0, SimpleNamespace(dp_size=1))
        run.resumed(4, optimizer, scheduler, tokens=4 * 32)  # a run of half this one's batch
        assert run.max_steps == 4 + (10 * 64 - 4 * 32) // 64 == 12
        assert scheduler.lr_lambdas[0](run.max_steps) == pytest.approx(0.1)  # the cosine's end
        for old in ["step_000001", "step_000002"]:
            (save_dir / old).mkdir(parents=True)
        (save_dir / "latest").write_text("step_000002")
        run.begin(5, optimizer)
        facts = bookkeeping.Facts(7.0, 1.0, True, True, False)
        run.end(facts, tokens=4 * 32 + 64)
        for _ in range(3):
            assert run.should_validate() is False and run.should_save() and not run.should_stop()
        assert log_file.read_text() == "" and (save_dir / "step_000001").exists()
        run.log_step()
        assert [json.loads(line)["step"] for line in log_file.read_text().splitlines()] == [5]
        run.save(lambda: (save_dir / "step_000005").mkdir())
        kept = sorted(p.name for p in save_dir.iterdir())
        # The latest one is never pruned; run.yaml, the run file, was written at the first step.
        assert kept == ["latest", "run.yaml", "step_000002", "step_000005"]
        run.close()
    finally:
        dist.destroy_process_group()
    assert vars(args) == given


def test_wsd_holds_the_rate_until_its_decay_then_falls_in_a_line():
    """--lr_schedule wsd: the warm-up, the peak held until the last --decay_fraction of the
    steps, then a straight line to 10 % at the last; during the warm-up, the cosine's factors."""
    train = import_step("step3_dataloader", "train")
    recipes = sys.modules["recipes"]
    flags = ["--max_steps", "100", "--warmup_steps", "10", "--decay_fraction", "0.2"]
    wsd = recipes.lr_factor(train.parse_args([*flags, "--lr_schedule", "wsd"]), 100)
    cosine = recipes.lr_factor(train.parse_args(flags), 100)
    assert [wsd(step) for step in range(10)] == [cosine(step) for step in range(10)]
    assert [wsd(step) for step in (10, 50, 80)] == [1.0, 1.0, 1.0]  # stable until step 80
    assert wsd(90) == pytest.approx(0.55) and wsd(100) == pytest.approx(0.1)  # 20 steps of decay
    assert cosine(50) < 1.0 and cosine(100) == pytest.approx(0.1)


def test_early_stopping_stops_and_saves_once_the_validation_loss_stalls(tmp_path):
    """--early_stopping_patience 1 at a learning rate too high to improve: the first validation
    that is not below the best stops the run there, saved, with its sample; the best one was
    saved when it came, `best` names it and --keep_last 1 keeps it; without the flag the run goes
    on to --max_steps."""
    save_dir = tmp_path / "ckpt"
    flags = ["--eval_every", "2", "--learning_rate", "0.05", "--save_dir", str(save_dir)]
    flags += ["--keep_last", "1", "--log_file", str(tmp_path / "log.jsonl")]
    result = step3(tmp_path, *flags, "--early_stopping_patience", "1", steps=12)
    stopped = max(losses(result.stdout))
    assert stopped < 12 and stopped % 2 == 0, result.stdout
    assert "stopping early (--early_stopping_patience 1)" in result.stdout
    assert (save_dir / "latest").read_text() == f"step_{stopped:06d}"
    validated = {
        r["step"]: r["val_loss"] for r in read_log(tmp_path / "log.jsonl") if "val_loss" in r
    }
    best = min(validated, key=validated.get)
    assert best < stopped and (save_dir / "best").read_text() == f"step_{best:06d}"
    kept = sorted(p.name for p in save_dir.glob("step_*"))
    assert kept == [f"step_{best:06d}", f"step_{stopped:06d}"]
    assert "sample:" in result.stdout
    whole = step3(tmp_path / "whole", "--eval_every", "2", "--learning_rate", "0.05", steps=12)
    assert max(losses(whole.stdout)) == 12
