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


@pytest.mark.parametrize("reshard", convergence.reshard_layouts(ACCUMULATION), ids=lambda r: r.name)
def test_a_run_that_changes_layout_halfway_trains_like_one_process(tmp_path, baseline, reshard):
    records = convergence.run_resharded(reshard, COMMON, tmp_path, 12, ENV, timeout=300)
    comparison = convergence.compare(records, baseline)
    print(f"\n{convergence.table({reshard.name: comparison})}")
    assert comparison.ok, comparison.problems


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
