"""tools/dynamics.py: its metrics against their definitions, and the learning dynamics of a
dp 2 x tp 2 run equal to one process's, where a run that learns otherwise differs."""

import json
import subprocess

import dynamics
import pytest
import torch
from conftest import LAUNCH, ROOT, TINY, check, run_step

# Forked from the tests' launch server, which has imported torch once for all of them.
TOOL = [*LAUNCH, "--python", str(ROOT / "tools" / "dynamics.py")]


def hsic_cka(x, y):
    """CKA from its definition: HSIC of the centred Gram matrices K = X X^T and L = Y Y^T."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1 / n
    k, l = h @ x @ x.T @ h, h @ y @ y.T @ h  # noqa: E741
    return ((k * l).sum() / ((k * k).sum() * (l * l).sum()).sqrt()).item()


def test_cka_and_pwcca_follow_their_definitions():
    torch.manual_seed(0)
    x = torch.randn(300, 12)
    y = torch.randn(300, 12) + 0.5 * x  # partly related
    assert dynamics.linear_cka(x, y) == pytest.approx(hsic_cka(x, y), abs=1e-12)
    rotation = torch.linalg.qr(torch.randn(12, 12))[0]
    assert dynamics.linear_cka(x, 3.0 * x @ rotation) == pytest.approx(1, abs=1e-12)
    assert dynamics.linear_cka(x, torch.randn(300, 12)) < 0.2  # unrelated: near 0
    mixed = x @ (torch.randn(12, 12) + 3 * torch.eye(12))  # any invertible map
    assert dynamics.pwcca(x, mixed) == pytest.approx(1, abs=1e-9)
    assert dynamics.linear_cka(x, mixed) < 0.999  # which CKA does not forgive
    assert dynamics.pwcca(x, torch.randn(300, 12)) < 0.5


def test_gini_and_hoyer_follow_their_definitions():
    n = 50
    one_hot, flat = torch.zeros(n), torch.full((n,), 0.3)
    one_hot[7] = -2.0  # sizes: the sign does not count
    assert dynamics.gini(flat) == pytest.approx(0, abs=1e-12)
    assert dynamics.gini(one_hot) == pytest.approx(1 - 1 / n, abs=1e-12)
    assert dynamics.hoyer(flat) == pytest.approx(0, abs=1e-12)
    assert dynamics.hoyer(one_hot) == pytest.approx(1, abs=1e-12)
    # Gini as the mean absolute difference over twice the mean, for any vector.
    a = torch.rand(n, dtype=torch.float64)
    mean_difference = (a[:, None] - a[None, :]).abs().mean()
    assert dynamics.gini(a) == pytest.approx((mean_difference / (2 * a.mean())).item(), abs=1e-12)


def train(tmp, name, nproc, *args):
    """A run's checkpoints at steps 2 and 4, captured by the tool after the run, or in the run
    with --save_dynamics."""
    save = tmp / name
    flags = [*TINY, "--max_steps", "4", "--save_every", "2", "--eval_every", "0"]
    flags += ["--sample_tokens", "0", "--save_dir", str(save), *args]
    check(run_step("step9_3d_parallel", flags, nproc=nproc, timeout=600))
    if "--save_dynamics" not in args:
        capture = subprocess.run([*TOOL, "capture", str(save)], capture_output=True, text=True)
        assert capture.returncode == 0, capture.stderr
    return save


def report(run, against, tmp):
    out = tmp / f"{run.name}_against_{against.name}.json"
    command = [*TOOL, "report", str(run), "--against", str(against), "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_a_dp2_tp2_run_has_the_dynamics_of_one_process(tmp_path):
    """Both runs' checkpoints at steps 2 and 4, the probe through each: the residual stream's
    CKA and PWCCA are 1 to rounding at every layer, the gradients point the same way, the
    activations agree to float32's rounding. Another initial seed, 4 steps of a tiny model:
    CKA falls far below (the metric tells runs apart). The dp 2 x tp 2 run captures its own
    checkpoints (--save_dynamics), each before --keep_last 1 removes it."""
    one = train(tmp_path, "one", 1, "--gradient_accumulation_steps", "2")
    layout = ["--dp_size", "2", "--tp_size", "2"]
    grid = train(tmp_path, "grid", 4, *layout, "--save_dynamics", "--keep_last", "1")
    assert [p.name for p in dynamics.checkpoints(grid)] == ["step_000004"]
    assert sorted(p.name for p in (grid / "dynamics").iterdir()) == [
        "step_000002.safetensors",
        "step_000004.safetensors",
    ]
    facts = report(grid, one, tmp_path)
    assert [pair["steps"] for pair in facts["pairs"]] == [[2, 2], [4, 4]]
    for pair in facts["pairs"]:
        for layer, (cka, pw) in pair["layers"].items():
            assert cka == pytest.approx(1, abs=1e-6), (pair["steps"], layer)
            assert pw == pytest.approx(1, abs=1e-6), (pair["steps"], layer)
        assert pair["grad_cosine"] == pytest.approx(1, abs=1e-6)
        assert pair["max_activation_diff"] < 1e-4
    other = train(tmp_path, "other", 1, "--gradient_accumulation_steps", "2", "--seed", "7")
    facts = report(other, one, tmp_path)
    assert max(cka for cka, _ in facts["pairs"][-1]["layers"].values()) < 0.9


def test_capture_refuses_a_folder_without_checkpoints(tmp_path):
    result = subprocess.run([*TOOL, "capture", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "has no checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
