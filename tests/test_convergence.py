"""tools/convergence.py: every parallel layout trains like step 3 on one process for 12 steps,
and the comparison catches each injected bug that parallel training is known for."""

import sys

import pytest
from conftest import ROOT, TINY

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

ACCUMULATION = 2  # the baseline's; the dp2 layouts take 1
COMMON = [*TINY, "--num_hidden_layers", "3", "--max_steps", "12", "--eval_every", "6"]
COMMON += ["--eval_steps", "2", "--num_proc", "1", "--sample_tokens", "4"]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
LAYOUTS = {layout.name: layout for layout in convergence.default_layouts(ACCUMULATION)}


def train(layout, out_dir, launcher=None):
    return convergence.run(layout, COMMON, out_dir, env=ENV, launcher=launcher, timeout=300)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    records = train(convergence.baseline_layout(ACCUMULATION), tmp_path_factory.mktemp("base"))
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    return records


def test_every_layout_trains_like_one_process(tmp_path, baseline):
    results = {}
    for name, layout in LAYOUTS.items():
        results[name] = convergence.compare(train(layout, tmp_path), baseline)
    print(f"\n{convergence.table(results)}")
    for name, comparison in results.items():
        assert comparison.ok, f"{name}: {comparison.problems}"
        assert len(comparison.steps) == 12 and comparison.max_val_loss is not None, name


def test_launcher_without_bug_changes_nothing(tmp_path, baseline):
    """The control for the test below: the launcher alone trains exactly like train.py."""
    launcher = convergence.inject(None, tmp_path)
    records = train(LAYOUTS["dp2_bucket"], tmp_path, launcher)
    comparison = convergence.compare(records, baseline)
    assert comparison.ok, comparison.problems


@pytest.mark.parametrize("bug", sorted(convergence.BUGS))
def test_injected_bug_is_caught(tmp_path, baseline, bug):
    layout = LAYOUTS[convergence.BUGS[bug][0]]
    records = train(layout, tmp_path, convergence.inject(bug, tmp_path))
    comparison = convergence.compare(records, baseline)
    print(f"\n{convergence.table({f'{layout.name} + {bug}': comparison})}")
    assert not comparison.ok
    assert len(comparison.steps) == 12  # it trained to the end: caught by the numbers alone


def test_unknown_bug_and_odd_accumulation_are_refused():
    with pytest.raises(ValueError, match="unknown bug 'typo'"):
        convergence.inject("typo")
    with pytest.raises(ValueError, match="accumulation=3 is odd"):
        convergence.default_layouts(3)


def test_compare_flags_a_nan_and_a_missing_step():
    base = [{"step": s, "loss": 5.0, "grad_norm": 1.0, "tokens": 64 * s} for s in (1, 2)]
    nan = [{**base[0], "loss": float("nan")}, base[1]]
    assert not convergence.compare(nan, base).ok
    assert not convergence.compare(base[:1], base).ok
    assert convergence.compare([dict(r) for r in base], base).ok


def test_cli_bug_runs_the_broken_layout_with_the_bug(tmp_path, monkeypatch, capsys):
    """`--bug NAME` runs the baseline as it is and the bug's layout through its launcher, and
    exits 1 when the comparison flags it. `run` is replaced by a stand-in that doubles the loss
    of a run started through a launcher, so no process starts."""
    calls = []

    def fake_run(layout, common_args, out_dir, env=None, launcher=None, timeout=600):
        calls.append((layout.name, launcher))
        factor = 2.0 if launcher else 1.0
        return [
            {"step": s, "loss": factor * 5.0, "grad_norm": 1.0, "tokens": 64 * s} for s in (1, 2)
        ]

    monkeypatch.setattr(convergence, "run", fake_run)
    argv = ["--bug", "pp_loss_not_divided", "--steps", "2", "--out_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        convergence.main(argv)
    assert exit_.value.code == 1
    assert [name for name, _ in calls] == ["baseline", "pp2_1f1b"]
    assert calls[0][1] is None and "pp_loss_not_divided" in calls[1][1].read_text()
    assert "on 2 with the bug pp_loss_not_divided" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one layout per bug: --layouts is refused beside it
        convergence.parse_args(["--bug", "tp_weights_differ", "--layouts", "tp2"])
    with pytest.raises(SystemExit):
        convergence.parse_args(["--bug", "typo"])
