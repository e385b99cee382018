"""tools/convergence.py: every parallel layout trains like step 3 on one process for 12 steps,
and the comparison catches each injected bug that parallel training is known for. A model with
tied embeddings trains like step 3 at every pipeline layout, its two copies of the tied weight
bit-identical after 20 steps."""

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY
from safetensors.torch import load_file

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

ACCUMULATION = 2  # the baseline's; the dp2 layouts take 1
COMMON = [*TINY, "--num_hidden_layers", "3", "--max_steps", "12", "--eval_every", "6"]
COMMON += ["--eval_steps", "2", "--num_proc", "1", "--sample_tokens", "4"]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
LAYOUTS = {layout.name: layout for layout in convergence.default_layouts(ACCUMULATION)}
TIED = {layout.name: layout for layout in convergence.tied_layouts(ACCUMULATION)}
# SmolLM-like (tied embeddings, grouped-query attention) at test size. 5 layers: pp2 (3 + 2) and
# pp3 (2 + 2 + 1) are uneven. 20 steps: the tied weight's two copies are compared after 20 updates.
TIED_COMMON = [*COMMON, "--num_hidden_layers", "5", "--max_steps", "20"]


def train(layout, out_dir, launcher=None, common=COMMON):
    return convergence.run(layout, common, out_dir, env=ENV, launcher=launcher, timeout=300)


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


def test_launcher_without_bug_changes_nothing(tmp_path, baseline, monkeypatch):
    """The control for the test below: the launcher alone trains exactly like train.py. Run from
    another folder than the repository's, with a relative out_dir, as a user may."""
    monkeypatch.chdir(tmp_path)
    launcher = convergence.inject(None, tmp_path)
    records = train(LAYOUTS["dp2_bucket"], Path("runs"), launcher)
    comparison = convergence.compare(records, baseline)
    assert comparison.ok, comparison.problems


@pytest.mark.parametrize("bug", sorted(convergence.BUGS))
def test_injected_bug_is_caught(tmp_path, request, bug):
    name = convergence.BUGS[bug][0]
    if name in TIED:
        layout, (common, baseline, _) = TIED[name], request.getfixturevalue("tied_baseline")
    else:
        layout, common, baseline = LAYOUTS[name], COMMON, request.getfixturevalue("baseline")
    records = train(layout, tmp_path, convergence.inject(bug, tmp_path), common)
    comparison = convergence.compare(records, baseline)
    print(f"\n{convergence.table({f'{layout.name} + {bug}': comparison})}")
    assert not comparison.ok
    assert len(comparison.steps) == len(baseline)  # trained to the end: caught by the numbers


@pytest.fixture(scope="module")
def tied_baseline(tmp_path_factory):
    """The tiny config with tied embeddings, step 3 trained with it on one process, and the
    folder of its console output."""
    tmp = tmp_path_factory.mktemp("tied")
    config = convergence.tied_config("tiny", tmp / "config")
    common = [*TIED_COMMON, "--model_name", str(config)]
    return common, train(convergence.baseline_layout(ACCUMULATION), tmp, common=common), tmp


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory, tied_baseline):
    """Every tied layout, trained once for the tests below. The runs of steps 7 and 8 save at
    steps 10 and 20, one file per stage and tp rank, read by the two tests after the first."""
    common = tied_baseline[0]
    tmp = tmp_path_factory.mktemp("tied_runs")
    runs = {}
    for name, layout in TIED.items():
        save = []
        if layout.step != convergence.STEP9:
            save = ["--save_dir", str(tmp / name), "--save_every", "10"]
        runs[name] = train(layout, tmp, common=[*common, *save])
    return runs, tmp


def test_tied_layouts_train_like_one_process(tied_baseline, tied_runs):
    """pp2 (AFAB), pp3 (1F1B), tp2 x pp2 and 2 x 2 x 2: 20 steps within the strict tolerances,
    and the same sample, drawn from the last stage's copy of the tied weight."""
    _, baseline, baseline_dir = tied_baseline
    results = {name: convergence.compare(records, baseline) for name, records in
               tied_runs[0].items()}  # fmt: skip
    print(f"\n{convergence.table(results)}")
    for name, comparison in results.items():
        assert comparison.ok, f"{name}: {comparison.problems}"
        assert len(comparison.steps) == 20 and comparison.max_val_loss is not None, name

    def sample(folder, name):
        return (folder / f"{name}.log").read_text().split("sample:")[1].splitlines()[0]

    for name in TIED:
        assert sample(tied_runs[1], name) == sample(baseline_dir, "baseline"), name


def sizes(layout):
    flags = dict(zip(layout.flags[::2], layout.flags[1::2], strict=True))
    return int(flags.get("--pp_size", 1)), int(flags.get("--tp_size", 1))


@pytest.mark.parametrize("name", [n for n, lay in TIED.items() if lay.step != convergence.STEP9])
def test_tied_copies_stay_bit_identical(tied_runs, name):
    """After 20 steps the first stage's embedding and the last stage's lm_head, each tp rank's
    slice, are the same tensor, and so are their AdamW moments."""
    pp, tp = sizes(TIED[name])
    folder = tied_runs[1] / name / "step_000020"
    for t in range(tp):
        first, last = f"pp0-of-{pp}-tp{t}-of-{tp}", f"pp{pp - 1}-of-{pp}-tp{t}-of-{tp}"
        embedding = load_file(folder / f"model-{first}.safetensors")["model.embed_tokens.weight"]
        head = load_file(folder / f"model-{last}.safetensors")["lm_head.weight"]
        assert torch.equal(embedding, head), (name, t)
        states = [torch.load(folder / f"trainer_state-{s}.pt")["optimizer"] for s in (first, last)]
        # The embedding is the first stage's first parameter, lm_head the last stage's last
        # matrix (the first parameter group holds the matrices, in the model's order).
        ids = states[0]["param_groups"][0]["params"][0], states[1]["param_groups"][0]["params"][-1]
        moments = [state["state"][i] for state, i in zip(states, ids, strict=True)]
        for key in ["exp_avg", "exp_avg_sq"]:
            assert torch.equal(moments[0][key], moments[1][key]), (name, t, key)
        assert moments[0]["exp_avg"].shape == moments[1]["exp_avg"].shape == embedding.shape


def test_tied_pp2_resumes_like_one_process(tmp_path, tied_baseline, tied_runs):
    """Step 7 saved at step 10 (each stage its copy) resumes and trains steps 11-20 like step 3."""
    common, baseline, _ = tied_baseline
    save = tmp_path / "ckpt"
    shutil.copytree(tied_runs[1] / "tied_pp2_afab" / "step_000010", save / "step_000010")
    (save / "latest").write_text("step_000010")
    layout = replace(TIED["tied_pp2_afab"], name="resumed")
    records = train(layout, tmp_path, common=[*common, "--save_dir", str(save), "--resume"])
    comparison = convergence.compare(records, baseline[10:])
    assert comparison.ok, comparison.problems
    assert [r["step"] for r in records] == list(range(11, 21))


def test_unknown_bug_and_odd_accumulation_are_refused():
    with pytest.raises(ValueError, match="unknown bug 'typo'"):
        convergence.inject("typo")
    with pytest.raises(ValueError, match=r"accumulation=3: the layout \w+ takes accumulation / 2"):
        convergence.default_layouts(3)
    with pytest.raises(ValueError, match="accumulation=3 is odd"):
        convergence.tied_layouts(3)
    with pytest.raises(ValueError, match=r"accumulation=3: the layout \w+ takes accumulation / 2"):
        convergence.zero1_layouts(3)
    with pytest.raises(ValueError, match="the layout ep2_dp4 takes accumulation / 4"):
        convergence.moe_layouts(2)


def test_zero1_and_cp_pick_their_steps_layouts(capsys):
    for flag, step in [("--zero1", convergence.STEP10), ("--cp", convergence.STEP11)]:
        _, layouts, _ = convergence.parse_args([flag, "--gradient_accumulation_steps", "4"])
        assert layouts and {layout.step for layout in layouts} == {step}
        for layout in layouts:  # the baseline's global batch: dp_size x accumulation = 4
            flags = dict(zip(layout.flags[::2], layout.flags[1::2], strict=True))
            assert int(flags.get("--dp_size", 1)) * layout.accumulation == 4, layout.name
    for argv in [["--zero1", "--cp"], ["--zero1", "--bug", "dp_not_averaged"]]:
        with pytest.raises(SystemExit):
            convergence.parse_args(argv)
    assert "give one of them" in capsys.readouterr().err


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
