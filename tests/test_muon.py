"""--optimizer muon (muon.py, from step 3): Muon's step equals torch.optim.Muon's and AdamW's for
the rest; under tp, ZeRO-1 over dp and ZeRO-3 with experts it trains like one process; a
checkpoint resumes in another layout, and not under the other optimizer."""

import shutil

import pytest
import torch
from conftest import TINY, assert_same_training, check, import_step, read_log, run_step

STEPS = 4  # enough for the momentum to matter: a wrong piece moves the loss from step 2 on
MUON = ["--optimizer", "muon", "--max_steps", str(STEPS), "--eval_every", "0"]
MUON += ["--sample_tokens", "0"]


def test_muon_step_equals_torch_muon_and_adamw():
    """Same gradients, three steps: Muon's matrices as torch.optim.Muon's (its Newton-Schulz in
    bfloat16, as torch's), the vectors as fused AdamW's. A tall matrix is transposed for NS and
    scaled by sqrt(rows / cols): the one place where the two differ, by one rounding."""
    muon = import_step("step3_dataloader", "muon")
    torch.manual_seed(0)
    ours = [torch.randn(8, 16), torch.randn(24, 8), torch.randn(16)]
    theirs = [p.clone() for p in ours]
    groups = [
        {"params": ours[:2], "muon": True, "lr": 0.02, "weight_decay": 0.1},
        {"params": ours[2:], "muon": False, "weight_decay": 0.0},
    ]
    optimizer = muon.Muon(groups, lr=1e-3, ns_dtype=torch.bfloat16)
    reference = [
        torch.optim.Muon(theirs[:2], lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(theirs[2:], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True),
    ]
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        optimizer.step()
        for other in reference:
            other.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    # What it gives: singular values of the same order, where the gradient's spread 1000-fold.
    gradient = torch.linalg.qr(torch.randn(64, 16))[0].T * torch.logspace(-3, 0, 16)[:, None]
    values = torch.linalg.svdvals(muon.orthogonalise(gradient))
    assert values.max() / values.min() < 4, values


def trained(step, tmp, name, nproc, *args):
    log = tmp / f"{name}.jsonl"
    check(run_step(step, [*TINY, *MUON, *args, "--log_file", str(log)], nproc=nproc, timeout=600))
    return read_log(log)


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    """Step 10, one process against ZeRO-1 at tp 2 x dp 2 (saving at step 2), and the latter's
    checkpoint resumed on one process."""
    tmp = tmp_path_factory.mktemp("muon_zero1")
    step = "step10_zero1"
    one = trained(step, tmp, "one", 1, "--gradient_accumulation_steps", "2")
    save = ["--save_dir", str(tmp / "ckpt"), "--save_every", "2"]
    grid = ["--tp_size", "2", "--dp_size", "2", "--bucket_size_mb", "0.05"]
    zero = trained(step, tmp, "zero1", 4, *grid, *save)
    # A folder whose latest checkpoint is step 2's, resumed from there.
    shutil.copytree(tmp / "ckpt" / "step_000002", tmp / "again" / "step_000002")
    (tmp / "again" / "latest").write_text("step_000002")
    again = ["--save_dir", str(tmp / "again"), "--resume", "--save_every", "100"]
    resumed = trained(step, tmp, "resumed", 1, "--gradient_accumulation_steps", "2", *again)
    return one, zero, resumed, tmp


def test_muon_under_tp_trains_like_one_process(tmp_path):
    """Step 4: each matrix put together from its tp slices before Newton-Schulz (OnWhole)."""
    one = trained("step4_tensor_parallel", tmp_path, "one", 1)
    tp2 = trained("step4_tensor_parallel", tmp_path, "tp2", 2, "--tp_size", "2")
    assert_same_training(tp2, one)


def test_muon_under_zero1_and_tp_trains_like_one_process(zero1):
    """Step 10: each bucket's updates gathered over dp, then each matrix over tp (on_whole)."""
    one, zero, _, _ = zero1
    assert_same_training(zero, one)


def test_a_muon_checkpoint_resumes_in_another_layout_and_not_under_adamw(zero1):
    """Saved at tp 2 x dp 2 (the momentum put together from the ZeRO shards), resumed on one
    process: steps 3 and 4 as the uninterrupted run's. Resumed with AdamW: refused, one line."""
    one, _, resumed, tmp = zero1
    assert_same_training(resumed, one[2:])
    args = [*TINY, "--max_steps", str(STEPS), "--save_dir", str(tmp / "again"), "--resume"]
    result = run_step("step10_zero1", [*args, "--gradient_accumulation_steps", "2"])
    assert result.returncode == 2, result.stderr
    assert "trained with --optimizer muon, this run has --optimizer adamw" in result.stderr
    assert "Traceback" not in result.stderr


def test_muon_under_zero3_with_experts_trains_like_one_process(tmp_path):
    """Step 15, a mixture of experts at dp 4 x ep 2, ZeRO-3: a dense matrix cut over dp, an
    expert's over edp (the dp ranks that hold it), each put together before Newton-Schulz."""
    step, moe = "step15_expert_parallel", ["--model_name", "tiny-moe", "--micro_batch_size", "1"]
    one = trained(step, tmp_path, "one", 1, *moe, "--gradient_accumulation_steps", "4")
    layout = ["--dp_size", "4", "--ep_size", "2", "--zero_stage", "3"]
    assert_same_training(trained(step, tmp_path, "ep2_zero3", 4, *moe, *layout), one)


def test_a_muon_learning_rate_of_zero_is_refused():
    result = run_step("step3_dataloader", [*TINY, *MUON, "--muon_learning_rate", "0"])
    assert result.returncode == 2
    assert "--muon_learning_rate must be above 0, got 0.0" in result.stderr
