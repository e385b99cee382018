"""--dtype float16 with dynamic loss scaling (recipes.LossScale, from step 3): the same
updates as PyTorch's GradScaler, an overflow on one rank skipped on every rank of tp 2 x pp 2, and
the scale resumed exactly from a checkpoint."""

import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROOT, TINY, check, import_step, read_log, run_step

S3, S9 = "step3_dataloader", "step9_3d_parallel"


def launcher(tmp_path, step, initial=None, overflow_on=None):
    """A script that runs `step`'s train.py with LossScale's first scale set to `initial`, and,
    with `overflow_on` = (rank, step), that rank's gradient norm made inf at that step only, as a
    rank whose gradients overflowed alone would have it."""
    script = tmp_path / f"launch_{step}.py"
    script.write_text(f"""
import os, runpy, sys
sys.path.insert(0, {str(ROOT / step)!r})
import torch
import bookkeeping
import recipes
if {initial!r} is not None:
    recipes.LossScale.INITIAL = {initial!r}
if {overflow_on!r} is not None:
    agree, calls = bookkeeping.agree, [0]
    def overflow_here(loss, grad_norm, *args, **kwargs):
        calls[0] += 1
        if (int(os.environ.get("RANK", 0)), calls[0]) == {overflow_on!r}:
            grad_norm = torch.full_like(grad_norm, float("inf"))
        return agree(loss, grad_norm, *args, **kwargs)
    bookkeeping.agree = overflow_here
sys.argv = [{str(ROOT / step / "train.py")!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    return str(script)


def test_the_scale_halves_on_an_overflow_doubles_after_finite_steps_and_gives_up():
    bookkeeping = import_step(S3, "bookkeeping")
    recipes = sys.modules["recipes"]
    scale = recipes.LossScale(SimpleNamespace(dtype="float16"))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scale.start(optimizer)
    assert recipes.loss_scale(optimizer) == 2.0**16
    ok = bookkeeping.Facts(1.0, 1.0, True, True, False)
    overflow = bookkeeping.Facts(1.0, math.inf, True, False, False)
    record = {}
    assert scale.update(overflow, optimizer, 1, record) is None
    assert record == {"loss_scale": 2.0**16, "overflow": True}
    assert recipes.loss_scale(optimizer) == 2.0**15
    for step in range(2, 2 + scale.GROWTH_INTERVAL):
        assert scale.update(ok, optimizer, step, {}) is None
    assert recipes.loss_scale(optimizer) == 2.0**16  # doubled after 2000 finite steps
    why = [scale.update(overflow, optimizer, 9000 + i, {}) for i in range(25)]
    assert why[:24] == [None] * 24 and "overflowed 25 steps in a row" in why[24]
    fp32 = recipes.LossScale(SimpleNamespace(dtype="float32"))
    fp32.start(optimizer := torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert recipes.loss_scale(optimizer) == 1.0 and "loss_scale" not in optimizer.param_groups[0]


def test_loss_scaling_updates_as_torch_grad_scaler():
    """Step 3's train_step under fp16 autocast, its LossScale starting at 2^24 so that the first
    steps overflow, against autocast with torch.amp.GradScaler from the same scale (unscale,
    clip, step, update): the same steps skipped, the same scales, and after two applied steps the
    same weights to rounding (later, fp16's rounding of two runs that differ in the last bit of a
    weight grows, as between any two implementations)."""
    train = import_step(S3, "train")
    recipes = sys.modules["recipes"]
    args = train.parse_args([*TINY, "--dtype", "float16", "--learning_rate", "1e-2"])
    config = train.load_config(args)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = train.Context(args, torch.device("cpu"), torch.float16, pgm=None)
        models, optimizers = [], []
        for _ in range(2):
            model = train.LlamaForCausalLM(config)
            model.init_weights(args.seed)
            models.append(model)
            optimizers.append(train.build_optimizer(ctx, model))
        (ours, (optimizer, scheduler)), (theirs, (their_optimizer, their_scheduler)) = zip(
            models, optimizers, strict=True
        )
        state = train.State(ours, ours, optimizer, scheduler, None, None, None)
        scale = recipes.LossScale(args)
        scale.INITIAL = 2.0**24
        scale.start(optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2000)
        generator = torch.Generator().manual_seed(0)
        scales, skipped = [], []
        for step in range(1, 13):
            tokens = torch.randint(0, config.vocab_size, (2, 2, 33), generator=generator)
            batch = [(t[:, :-1], t[:, 1:]) for t in tokens]
            facts = train.train_step(ctx, state, batch)
            assert scale.update(facts, optimizer, step, {}) is None
            their_optimizer.zero_grad(set_to_none=True)
            for inputs, targets in batch:
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = theirs(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / 2
                scaler.scale(loss).backward()
            scaler.unscale_(their_optimizer)
            torch.nn.utils.clip_grad_norm_(theirs.parameters(), args.grad_clip)
            before = scaler.get_scale()
            scaler.step(their_optimizer)
            scaler.update()
            if scaler.get_scale() >= before:  # applied: ours moves its schedule only then
                their_scheduler.step()
            skipped.append((not facts.finite, scaler.get_scale() < before))
            scales.append((recipes.loss_scale(optimizer), scaler.get_scale()))
            if sum(not a for a, _ in skipped) == 2:  # fp16 then magnifies rounding, step by step
                break
    finally:
        dist.destroy_process_group()
    assert all(a == b for a, b in skipped) and any(a for a, _ in skipped), skipped
    assert [a for a, _ in skipped].count(False) == 2, skipped
    assert all(a == b for a, b in scales), scales
    for (name, mine), their in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        difference = (mine - their).abs().max() / their.abs().max()
        assert difference < 1e-6, (name, difference.item())


def test_an_overflow_on_one_rank_is_skipped_on_every_rank(tmp_path):
    """tp 2 x pp 2 in fp16, rank 3's gradients (stage 1, tp rank 1) overflowing alone at step 2:
    every rank skips it and halves the scale, and the run logs what one process logs with the
    same overflow (fp16's rounding in another layout: the losses to 1e-4). A rank that decided
    alone would update its own slice and no other, and the others would not halve the scale."""
    flags = [*TINY, "--dtype", "float16", "--warmup_steps", "2"]
    flags += ["--max_steps", "5", "--num_proc", "1", "--eval_steps", "1", "--sample_tokens", "0"]
    one = tmp_path / "one.jsonl"
    script = launcher(tmp_path, S3, overflow_on=(0, 2))
    check(run_step(S3, [*flags, "--log_file", str(one)], torchrun=False, script=script))
    grid = tmp_path / "grid.jsonl"
    layout = ["--tp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b", "--log_file", str(grid)]
    script = launcher(tmp_path, S9, overflow_on=(3, 2))
    check(run_step(S9, [*flags, *layout], nproc=4, script=script))
    expected, got = read_log(one), read_log(grid)
    assert [r.get("overflow") for r in got] == [None, True, None, None, None]
    assert [r["loss_scale"] for r in got] == [r["loss_scale"] for r in expected]
    assert got[2]["loss_scale"] == 2.0**15
    for want, have in zip(expected, got, strict=True):
        assert have["loss"] == pytest.approx(want["loss"], rel=1e-4), (have["step"], have, want)


def test_the_scale_resumes_exactly(tmp_path):
    """From 2^40 the first steps overflow and the scale falls; 6 steps straight and 3 + resume +
    3 log the same losses and scales (the scale and its count travel in the optimizer's state)."""
    flags = [*TINY, "--dtype", "float16", "--num_proc", "1", "--eval_steps", "1"]
    flags += ["--sample_tokens", "0", "--max_steps", "6"]
    script = launcher(tmp_path, S3, initial=2.0**40)
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    check(run_step(S3, [*flags, "--log_file", str(straight)], torchrun=False, script=script))
    save = ["--save_dir", str(tmp_path / "ckpt"), "--save_every", "3"]
    first = ["--log_file", str(tmp_path / "first.jsonl")]
    check(run_step(S3, [*flags, *save, *first], torchrun=False, script=script))
    (tmp_path / "ckpt" / "latest").write_text("step_000003")
    then = ["--resume", "--log_file", str(resumed)]
    check(run_step(S3, [*flags, *save, *then], torchrun=False, script=script))
    records = read_log(straight)
    assert records[0].get("overflow") and records[0]["loss_scale"] == 2.0**40
    assert records[3]["loss_scale"] < 2.0**40
    keys = ["loss", "grad_norm", "loss_scale", "overflow"]
    expected = [{k: r.get(k) for k in keys} for r in records[3:]]
    assert [{k: r.get(k) for k in keys} for r in read_log(resumed)] == expected


def test_the_router_losses_gradient_is_scaled_like_the_loss():
    """Step 15's router losses ride on the layers' outputs (AttachLoss): under fp16 their
    gradient is the loss scale, as the main loss's is, so the two stay in proportion."""
    moe = import_step("step15_expert_parallel", "moe")
    y = torch.randn(2, 3, requires_grad=True)
    loss = torch.tensor(0.5, requires_grad=True)
    out = moe.AttachLoss.apply(y, loss * 1.0, torch.zeros(4), [], 2.0**16)
    (out * 2.0**16).sum().backward()  # the main loss, scaled
    assert loss.grad == 2.0**16 and torch.equal(y.grad, torch.full_like(y, 2.0**16))
