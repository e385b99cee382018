"""Step 9: a checkpoint saved in one parallel layout resumes in any other and trains on exactly
like the uninterrupted run; bad checkpoints and impossible layouts are refused before any weight
is read; tools/export_hf.py reads the new checkpoints."""

import json
import shutil
import sys

import pytest
import torch
import transformers
from conftest import (
    ROOT,
    TINY,
    assert_same_training,
    assert_weights_readable_as_config,
    check,
    import_step,
    read_log,
    run_step,
)
from safetensors.torch import load_file, save_file

STEP = "step9_3d_parallel"
SHAPE = [*TINY, "--num_key_value_heads", "4"]  # tp 4 needs 4 key/value heads
COMMON = [*SHAPE, "--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "2"]
COMMON += ["--eval_every", "0"]  # validation at the last step only
ROWS = 4  # the global batch: micro_batch_size 2 x gradient_accumulation_steps x dp_size


def layout(tp=1, pp=1, dp=1):
    """The flags and the number of processes of a layout that keeps the global batch."""
    flags = ["--tp_size", str(tp), "--pp_size", str(pp), "--dp_size", str(dp)]
    flags += ["--pp_engine", "1f1b", "--gradient_accumulation_steps", str(ROWS // (2 * dp))]
    return flags, tp * pp * dp


def train(name, where, flags, nproc, max_steps, run_dir, *extra):
    log_file = where / f"{name}.jsonl"
    args = [*COMMON, *flags, "--max_steps", str(max_steps), "--save_dir", str(run_dir)]
    args += ["--log_file", str(log_file), *extra]
    result = check(run_step(STEP, args, nproc=nproc))
    return read_log(log_file), result.stdout


def copy_checkpoint(step_folder, run_dir):
    """A run folder whose latest checkpoint is a copy of `step_folder`."""
    shutil.copytree(step_folder, run_dir / step_folder.name)
    (run_dir / "latest").write_text(step_folder.name)
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """12 steps at tp 2 x pp 2 without a break, checkpoints at steps 6 and 12."""
    where = tmp_path_factory.mktemp("reference")
    flags, nproc = layout(tp=2, pp=2)
    records, _ = train("reference", where, flags, nproc, 12, where / "run", "--save_every", "6")
    assert [r["step"] for r in records] == list(range(1, 13))
    return records, where / "run" / "step_000006"


def resume(name, where, step_folder, flags, nproc, max_steps, *extra):
    run_dir = copy_checkpoint(step_folder, where / f"{name}-run")
    return train(name, where, flags, nproc, max_steps, run_dir, "--resume", *extra)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, reference):
    """Steps 7-12 in one process from the tp 2 x pp 2 checkpoint, saving at steps 9 and 12."""
    where = tmp_path_factory.mktemp("one_process")
    records, stdout = resume("one", where, reference[1], *layout(), 12, "--save_every", "3")
    return records, stdout, where / "one-run" / "step_000009"


@pytest.mark.parametrize("sizes", [{"dp": 2, "pp": 2}, {"tp": 4}], ids=["dp2_pp2", "tp4"])
def test_checkpoint_resumes_in_another_layout(tmp_path, reference, sizes):
    records, step_6 = reference
    resumed, stdout = resume("resumed", tmp_path, step_6, *layout(**sizes), 12)
    assert "saved at tp 2 x pp 2 x dp 1" in stdout
    assert "global batch" not in stdout  # kept: nothing to say
    assert_same_training(resumed, records[6:])


def test_checkpoint_resumes_in_one_process(reference, one_process):
    records, _ = reference
    resumed, stdout, _ = one_process
    assert "saved at tp 2 x pp 2 x dp 1, running at tp 1 x pp 1 x dp 1" in stdout
    assert_same_training(resumed, records[6:])


def test_one_process_checkpoint_resumes_on_eight_ranks(tmp_path, reference, one_process):
    records, _ = reference
    step_9 = one_process[2]
    resumed, stdout = resume("grid", tmp_path, step_9, *layout(tp=2, pp=2, dp=2), 12)
    assert "saved at tp 1 x pp 1 x dp 1, running at tp 2 x pp 2 x dp 2" in stdout
    assert_same_training(resumed, records[9:])


def test_a_changed_global_batch_is_said_and_training_goes_on(tmp_path, reference):
    """dp 2 with 2 micro-batches each: 8 rows a step instead of 4, from the same row on; and
    twice the learning rate (3e-3 by default), which the run follows from there: in warm-up (10
    steps), step 7 trains at 7 / 10 of it. The tokens count the rows of both batch sizes, and
    --max_tokens stops the run when they reach it (1024 tokens: 6 steps of 128, then one of 256)."""
    flags, nproc = layout(dp=2)
    flags[flags.index("--gradient_accumulation_steps") + 1] = "2"
    flags += ["--learning_rate", "6e-3", "--max_tokens", "1024"]
    resumed, stdout = resume("bigger", tmp_path, reference[1], flags, nproc, 100)
    stop = "--max_tokens 1024: 768 tokens trained by step 6, then 256 a step: the run stops after"
    assert f"{stop} step 7\n" in stdout
    assert "the learning rate of step 7 is 4.200e-03 with this run's" in stdout
    assert "the saved run's was 2.100e-03" in stdout
    assert resumed[0]["lr"] == pytest.approx(6e-3 * 7 / 10, rel=1e-12)
    assert resumed[0]["tokens"] == (6 * 4 + 8) * 32  # 6 steps of 4 rows, then one of 8
    assert (
        "the global batch (micro_batch_size x gradient_accumulation_steps x dp_size) changes "
        "from 4 rows (2 x 2 x 1) of 32 tokens to 8 rows (2 x 2 x 2) of 32 tokens; training "
        "goes on from row 24 of the data"
    ) in stdout
    assert [r["step"] for r in resumed] == [7]


def test_tied_embeddings_are_stored_once_and_resume(tmp_path):
    """A tied model at tp 2 saves the table once, as embed_tokens; one process resumes it (its
    lm_head is the same parameter) and trains on like the run that did not stop."""
    config = json.loads((ROOT / "assets" / "configs" / "tiny" / "config.json").read_text())
    (tmp_path / "tied").mkdir()
    (tmp_path / "tied" / "config.json").write_text(
        json.dumps({**config, "tie_word_embeddings": True})
    )
    tied = ["--model_name", str(tmp_path / "tied")]
    flags, nproc = layout(tp=2)
    args = [*tied, *flags]
    records, _ = train("tied", tmp_path, args, nproc, 6, tmp_path / "run", "--save_every", "4")
    step_4 = tmp_path / "run" / "step_000004"
    index = json.loads((step_4 / "index.json").read_text())
    assert "lm_head.weight" not in index["model"] and "model.embed_tokens.weight" in index["model"]
    flags, nproc = layout()
    resumed, _ = resume("one", tmp_path, step_4, [*tied, *flags], nproc, 6)
    assert_same_training(resumed, records[4:])


def checkpoint_module():
    return import_step(STEP, "checkpoint")


def tiny_config():
    return transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip


def test_the_reference_checkpoint_passes_the_checks(reference):
    index = checkpoint_module().check_checkpoint(reference[1])
    assert index["layout"] == {"tp_size": 2, "pp_size": 2, "dp_size": 1}
    assert index["model"]["model.layers.0.self_attn.o_proj.weight"] == {
        "shape": [64, 64],
        "pieces": [
            {"file": "model-pp0-of-2-tp0-of-2.safetensors", "start": [0, 0], "size": [64, 32]},
            {"file": "model-pp0-of-2-tp1-of-2.safetensors", "start": [0, 32], "size": [64, 32]},
        ],
    }
    assert_weights_readable_as_config(reference[1])


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "is incomplete: model-pp1-of-2-tp0-of-2.safetensors is missing"),
        ("truncated", "model-pp1-of-2-tp0-of-2.safetensors cannot be read"),
        ("no_state", "is incomplete: trainer_state.pt is missing"),
        ("state_cut", "trainer_state.pt is truncated or damaged"),
        ("index_cut", "index.json is not valid JSON"),
        ("index_other", "index.json is not a checkpoint index"),
    ],
)
def test_a_damaged_checkpoint_is_refused(tmp_path, reference, damage, message):
    folder = shutil.copytree(reference[1], tmp_path / "step_000006")
    shard = folder / "model-pp1-of-2-tp0-of-2.safetensors"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "no_state":
        (folder / "trainer_state.pt").unlink()
    elif damage == "state_cut":  # a copy interrupted: the zip index at the end is gone
        state = folder / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:-100])
    elif damage == "index_cut":
        index = folder / "index.json"
        index.write_text(index.read_text()[:-10])
    else:
        (folder / "index.json").write_text('{"model": {}}')
    with pytest.raises(ValueError, match=message):
        checkpoint_module().check_checkpoint(folder)


def test_a_checkpoint_of_another_model_is_refused(reference):
    """Against the model the run built (here one process's, on the meta device), before any
    weight is read."""
    config = tiny_config()
    config.num_hidden_layers = 3
    with torch.device("meta"):
        model = import_step(STEP, "model").LlamaForCausalLM(config)
    checkpoint = checkpoint_module()
    index = checkpoint.check_checkpoint(reference[1])
    with pytest.raises(ValueError, match=r"another model .*3 layers.*missing \[model\.layers\.2"):
        checkpoint.check_model(reference[1], index, model, torch.optim.AdamW(model.parameters()))


def test_the_trainer_refuses_a_checkpoint_without_a_tensor_of_its_model(tmp_path, reference):
    """The last stage's final norm missing from index.json: the run (one process) stops with
    exit status 2 and the message, once the model is built and before any weight is read."""
    run_dir = copy_checkpoint(reference[1], tmp_path / "run")
    index = json.loads((run_dir / "step_000006" / "index.json").read_text())
    del index["model"]["model.norm.weight"]
    (run_dir / "step_000006" / "index.json").write_text(json.dumps(index))
    result = run_step(STEP, [*COMMON, "--save_dir", str(run_dir), "--resume"], torchrun=False)
    assert result.returncode == 2, result.stderr
    assert "holds another model than this one (2 layers" in result.stderr
    assert "missing [model.norm.weight], unexpected [], other shapes []" in result.stderr
    assert "Traceback" not in result.stderr and "resumed from" not in result.stdout


def earlier_format(index):
    """index.json as it was written before the boxes: one split "dim" per tensor (None when whole),
    and an integer start and size along it."""
    for entry in (e for section in ["model", "optimizer"] for e in index[section].values()):
        pieces = entry["pieces"]
        split = {d for p in pieces for d, n in enumerate(p["size"]) if n != entry["shape"][d]}
        assert len(split) <= 1, entry  # this layout splits each tensor on one dim at most
        entry["dim"] = dim = next(iter(split), None)
        entry["pieces"] = [
            {"file": p["file"], "start": 0, "size": None}
            if dim is None
            else {"file": p["file"], "start": p["start"][dim], "size": p["size"][dim]}
            for p in pieces
        ]
    return index


def test_a_checkpoint_of_the_earlier_index_resumes(tmp_path, reference):
    """An index.json of the earlier format is read as boxes (by steps 9, 10 and 11, and by
    tools/export_hf.py): the same index, the same exported model, and a resume in one process
    trains on exactly like the run that did not stop."""
    records, step_6 = reference
    folder = shutil.copytree(step_6, tmp_path / "old" / "step_000006")
    index = json.loads((folder / "index.json").read_text())
    old = earlier_format(json.loads((folder / "index.json").read_text()))
    assert old["model"]["model.norm.weight"] == {
        "shape": [64],
        "dim": None,
        "pieces": [{"file": "model-pp1-of-2-tp0-of-2.safetensors", "start": 0, "size": None}],
    }
    (folder / "index.json").write_text(json.dumps(old))
    for step in [STEP, "step10_zero1", "step11_context_parallel"]:
        assert import_step(step, "checkpoint").check_checkpoint(folder) == index, step
    new, _ = export_tool().load_merged_state_dict(step_6)
    converted, _ = export_tool().load_merged_state_dict(folder)
    assert new.keys() == converted.keys()
    assert all(torch.equal(new[key], converted[key]) for key in new)
    resumed, _ = resume("old", tmp_path, folder, *layout(), 12)
    assert_same_training(resumed, records[6:])


def test_an_old_checkpoint_is_refused_with_how_to_convert_it(tmp_path):
    """The earlier format: one weight file and one trainer state per rank, no index.json."""
    for shard in ["pp0-of-2-tp0-of-1", "pp1-of-2-tp0-of-1"]:
        save_file({"x": torch.zeros(1)}, tmp_path / f"model-{shard}.safetensors")
        torch.save({"step": 6}, tmp_path / f"trainer_state-{shard}.pt")
    with pytest.raises(ValueError, match="earlier format") as error:
        checkpoint_module().check_checkpoint(tmp_path)
    assert f"tools/export_hf.py {tmp_path} {tmp_path}-hf" in str(error.value)
    assert f"--init_from_hf {tmp_path}-hf" in str(error.value)


@pytest.mark.parametrize(
    "sizes, message",
    [
        (["--tp_size", "3"], r"at tp 3 x pp 1: tp_size=3 does not divide num_attention_heads=4"),
        (["--pp_size", "3"], r"at tp 1 x pp 3: pp_size=3 is larger than num_hidden_layers=2"),
    ],
)
def test_a_layout_the_model_cannot_take_is_refused(reference, sizes, message):
    train = import_step(STEP, "train")
    args = train.parse_args([*SHAPE, *sizes, "--save_dir", str(reference[1].parent), "--resume"])
    with pytest.raises(ValueError, match=message) as error:
        train.check_resume(
            train.find_checkpoint(args), train.load_config(args), args, train.check_layout
        )
    assert "This model takes tp_size in [1, 2, 4] and pp_size up to 2" in str(error.value)


def test_the_trainer_refuses_a_missing_shard_before_building_the_model(tmp_path, reference):
    run_dir = copy_checkpoint(reference[1], tmp_path / "run")
    (run_dir / "step_000006" / "optimizer-pp0-of-2-tp1-of-2.safetensors").unlink()
    result = run_step(STEP, [*COMMON, "--save_dir", str(run_dir), "--resume"], torchrun=False)
    assert result.returncode != 0
    assert "optimizer-pp0-of-2-tp1-of-2.safetensors is missing" in result.stderr
    assert "parameters per rank" not in result.stdout  # refused before the model was built


def export_tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import export_hf
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return export_hf


def test_export_reads_the_index_and_refuses_what_the_model_would_not_use(tmp_path, reference):
    """The exported model is the checkpoint's; a tensor that the model has no place for is named,
    whether index.json lists it or only a shard file holds it."""
    export_hf = export_tool()
    folder = shutil.copytree(reference[1], tmp_path / "step_000006")
    state_dict, _ = export_hf.load_merged_state_dict(folder)
    last = load_file(folder / "model-pp1-of-2-tp1-of-2.safetensors")
    head = "lm_head.weight"  # rows 1024-2047 of the vocabulary, at tp rank 1
    assert torch.equal(state_dict[head][1024:], last[head])
    extra = "model.layers.7.mlp.up_proj.weight"
    save_file({**last, extra: torch.zeros(2)}, folder / "model-pp1-of-2-tp1-of-2.safetensors")
    with pytest.raises(ValueError, match=f"does not list: {extra}"):
        export_hf.load_merged_state_dict(folder)
    index = json.loads((folder / "index.json").read_text())
    file = "model-pp1-of-2-tp1-of-2.safetensors"
    index["model"][extra] = {"shape": [2], "pieces": [{"file": file, "start": [0], "size": [2]}]}
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"unexpected \[{extra}\]"):
        export_hf.load_merged_state_dict(folder)
