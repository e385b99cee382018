"""Steps 9-11's checkpoint index reads the placement record: a piece is a box, a start and a size
per dim, so a parameter split on two dims (or twice on one) is saved by the ranks that hold its
pieces and read back in another layout; and the names and shapes a checkpoint must hold are those
of the model the run built, a parameter that the dense Llama lacks included; and before the first
checkpoint, the disk check predicts its bytes from the same placements."""

import inspect
import itertools
import json
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, assert_same_training, check, import_step, read_log, run_step, step_dir

STEPS = ["step9_3d_parallel", "step10_zero1", "step11_context_parallel"]
# name: (full shape, the record as it is saved at tp 2 x dp 2, as it is read at tp 3 x dp 3),
# each record a list of (axis, dim) splits, outermost first, or an empty list: whole everywhere.
PARAMETERS = {
    "mlp.weight": ((12, 12), [("tp", 0), ("dp", 1)], [("tp", 0), ("dp", 1)]),  # two dims
    "attn.weight": ((12, 6), [("tp", 0), ("dp", 0)], [("tp", 1)]),  # a shard of a shard
    "norm.weight": ((12,), [("dp", 0)], [("tp", 0)]),  # as ZeRO-3 would split it
    "bias": ((6,), [], []),  # whole on every rank: written once
}
MOMENTS = ["exp_avg", "exp_avg_sq"]


def full_tensors(seed):
    """{name: {"param", "exp_avg", "exp_avg_sq"}: a full tensor each}."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: {key: torch.randn(shape, generator=generator) for key in ["param", *MOMENTS]}
        for name, (shape, _, _) in PARAMETERS.items()
    }


def rank_of(placement, coords, sizes, which):
    """This fake rank's model, its AdamW state ({parameter: state}) and its grid (`pgm`):
    every parameter's piece as the record `which` (1: saved, 2: read) places it."""
    full, model, moments = full_tensors(seed=0), torch.nn.Module(), {}
    model.config = SimpleNamespace(tie_word_embeddings=False)
    for name, spec in PARAMETERS.items():
        splits = [placement.Split(a, d, coords[a], sizes[a]) for a, d in spec[which]]
        module, attr = model, name
        if "." in name:
            module, attr = torch.nn.Module(), name.split(".")[1]
            model.add_module(name.split(".")[0], module)
        param = torch.nn.Parameter(placement.piece(full[name]["param"], splits).clone())
        setattr(module, attr, param)
        placement.place(module, attr, *splits)
        state = {m: placement.piece(full[name][m], splits).clone() for m in MOMENTS}
        moments[param] = {"step": torch.tensor(5.0), **state}
    grid = {}  # each axis's coordinate and size; pp and cp: 0 of 1
    for axis in ["dp", "pp", "cp", "tp"]:
        grid.update({f"{axis}_rank": coords.get(axis, 0), f"{axis}_size": sizes.get(axis, 1)})
    return model, moments, SimpleNamespace(**grid)


def save(checkpoint, placement, folder, sizes):
    """What save_checkpoint writes, from every rank of a tp x dp grid in turn."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # the files' permissions are copied from it
    torch.save({}, folder / "trainer_state.pt")
    everyone = []
    for tp, dp in itertools.product(range(sizes["tp"]), range(sizes["dp"])):
        model, moments, pgm = rank_of(placement, {"tp": tp, "dp": dp}, sizes, which=1)
        if "optimizer" in inspect.signature(checkpoint.write_slices).parameters:  # step 9
            moments = SimpleNamespace(state=moments)  # the optimizer, as write_slices reads it
        everyone.append(checkpoint.write_slices(folder, model, moments, pgm))
    index = {"layout": {f"{axis}_size": size for axis, size in sizes.items()}}
    checkpoint.write_index(folder / "index.json", {**index, **checkpoint.build_index(everyone)})


@pytest.mark.parametrize("step", STEPS)
def test_pieces_split_on_two_dims_are_read_back_in_another_layout(tmp_path, step):
    """Saved at tp 2 x dp 2, every rank's piece of a parameter split on dims 0 and 1, twice on
    dim 0 or once over dp only is read back at tp 3 x dp 3, where each rank's box overlaps several
    saved pieces in part; the AdamW moments travel the same way."""
    checkpoint = import_step(step, "checkpoint")
    placement = sys.modules["placement"]  # the step's own, as checkpoint.py imports it
    save(checkpoint, placement, tmp_path / "ckpt", {"tp": 2, "dp": 2})
    index = checkpoint.check_checkpoint(tmp_path / "ckpt")
    files = sorted(path.name for path in (tmp_path / "ckpt").glob("*.safetensors"))
    # Named by the axes the parameters are spread over, in grid order (dp, then tp).
    names = [f"dp{d}-of-2-tp{t}-of-2" for d in range(2) for t in range(2)]
    assert files == sorted(f"{s}-{n}.safetensors" for s in ["model", "optimizer"] for n in names)
    assert index["model"]["mlp.weight"]["pieces"][1] == {
        "file": "model-dp1-of-2-tp0-of-2.safetensors",
        "start": [0, 6],
        "size": [6, 6],
    }
    assert len(index["model"]["bias"]["pieces"]) == 1  # whole on every rank: written once
    assert index["optimizer"]["mlp.weight.step"]["pieces"] == [
        {"file": "optimizer-dp0-of-2-tp0-of-2.safetensors", "start": [], "size": []}
    ]
    full, sizes = full_tensors(seed=0), {"tp": 3, "dp": 3}
    for tp, dp in itertools.product(range(3), range(3)):
        model, _, _ = rank_of(placement, {"tp": tp, "dp": dp}, sizes, which=2)
        expected = {p.name: p.param.detach().clone() for p in placement.placed_parameters(model)}
        for p in model.parameters():
            p.data.zero_()
        states = checkpoint.read_parameters(tmp_path / "ckpt", index, model)
        for placed in placement.placed_parameters(model):
            name, splits = placed.name, placed.splits
            assert torch.equal(placed.param, expected[name]), (name, tp, dp)
            state = states[placed.param]
            for m in MOMENTS:
                assert torch.equal(state[m], placement.piece(full[name][m], splits)), (name, m)
            assert state["step"].item() == 5.0 and state["step"].ndim == 0


@pytest.mark.parametrize("step", STEPS)
def test_pieces_that_do_not_tile_the_tensor_are_a_bug(step):
    """build_index asserts that the pieces fill each tensor exactly: none outside it, none
    overlapping another, none missing."""
    checkpoint = import_step(step, "checkpoint")

    def pieces(*boxes):
        return [[("model", "w", [4, 6], {"file": "f", "start": s, "size": n}) for s, n in boxes]]

    checkpoint.build_index(pieces(([0, 0], [4, 3]), ([0, 3], [4, 3])))
    for boxes in [
        [([0, 0], [4, 2]), ([0, 3], [4, 4])],  # one reaching outside, as many values
        [([0, 0], [4, 3]), ([0, 2], [4, 3])],  # overlapping, as many values
        [([0, 0], [4, 3]), ([0, 3], [3, 3])],  # a row missing
    ]:
        with pytest.raises(AssertionError):
            checkpoint.build_index(pieces(*boxes))


def add_router(model):
    """A parameter that the dense Llama does not have, with its placement record, as an MoE
    router would be (one process: tp 1, pp 1): the last layer's MLP output scaled by (1 + router),
    so that it trains."""
    placement = sys.modules["placement"]
    mlp = model.model.layers[str(model.config.num_hidden_layers - 1)].mlp
    mlp.router = torch.nn.Parameter(torch.linspace(-0.5, 0.5, model.config.hidden_size))
    placement.place(mlp, "router", placement.Split("tp", 0, 0, 1), placement.Held("pp", 0))
    mlp.register_forward_hook(lambda module, args, out: out * (1 + module.router))
    return model


def train_in_process(train, argv, extra):
    """train.main(argv) in this process, with `extra(model)` applied to the model it builds."""
    build = train.build_model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "build_model", lambda *args, **kw: extra(build(*args, **kw)))
        try:
            train.main(argv)
        finally:
            if dist.is_initialized():  # refused after the group of one was made
                dist.destroy_process_group()


def test_a_parameter_the_dense_model_lacks_is_saved_and_resumed(tmp_path):
    """A run whose model has a parameter of its own (as an MoE router) saves it and its AdamW
    state, and resumes with the same losses; a resume whose model lacks it, or whose checkpoint
    lacks it, is refused with what is unexpected or missing, before any weight is read."""
    train = import_step("step9_3d_parallel", "train")
    args = [*TINY, "--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "2"]
    args += ["--eval_every", "0", "--max_steps", "4"]
    log = tmp_path / "run.jsonl"
    argv = [*args, "--save_dir", str(tmp_path / "run"), "--save_every", "2", "--log_file", str(log)]
    train_in_process(train, argv, add_router)
    step_2 = tmp_path / "run" / "step_000002"
    index = json.loads((step_2 / "index.json").read_text())
    router = "model.layers.1.mlp.router"
    assert index["model"][router]["shape"] == [64]
    assert f"{router}.exp_avg" in index["optimizer"]
    for name in ["resumed", "refused"]:
        shutil.copytree(step_2, tmp_path / name / "step_000002")
        (tmp_path / name / "latest").write_text("step_000002")
    argv = [*args, "--save_dir", str(tmp_path / "resumed"), "--resume"]
    argv += ["--log_file", str(tmp_path / "resumed.jsonl")]
    train_in_process(train, argv, add_router)
    assert_same_training(read_log(tmp_path / "resumed.jsonl"), read_log(log)[2:])
    argv = [*args, "--save_dir", str(tmp_path / "refused"), "--resume"]
    name = re.escape(router)
    with pytest.raises(ValueError, match=rf"another model .*, unexpected \[{name}\]"):
        train_in_process(train, argv, lambda model: model)
    for section, keys in [("model", [router]), ("optimizer", [f"{router}.{m}" for m in MOMENTS])]:
        for key in keys:
            del index[section][key]
    (tmp_path / "refused" / "step_000002" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"another model .*: missing \[{name}\]"):
        train_in_process(train, argv, add_router)


NO_ROOM_ONCE = """import sys
sys.path.insert(0, {step!r})
import retention
import train
import utils

real, calls = retention.shutil.disk_usage, []


def usage(path):  # the first question finds a full disk, the next ones the real one
    calls.append(path)
    return real(path)._replace(free=0) if len(calls) == 1 else real(path)


retention.shutil.disk_usage = usage
utils.run_main(train.main)
"""


@pytest.mark.parametrize(
    "step, name, flags",
    [
        ("step10_zero1", "zero1_dp2", ["--dp_size", "2"]),
        ("step15_expert_parallel", "zero1_dp2", ["--dp_size", "2"]),
        (
            "step15_expert_parallel",
            "moe_ep2",
            ["--model_name", "tiny-moe", "--dp_size", "2", "--ep_size", "2"],
        ),
    ],
)
def test_the_disk_estimate_is_what_a_checkpoint_writes(tmp_path, step, name, flags):
    """Before the first checkpoint the run predicts its bytes from the placements (each piece on
    the rank that writes it, with AdamW's two moments): the first save finds no room and says
    how much it needed (--low_disk skip_save), the second writes; the prediction is the bytes of
    its weight and optimizer files within 1 % (their headers, measured: 0.2-0.4 %). Dividing
    what each rank holds by the replicas undercounts ZeRO's sharded optimizer state by dp and
    the experts, held once per ep rank, by ep."""
    launcher = tmp_path / "no_room_once.py"
    launcher.write_text(NO_ROOM_ONCE.format(step=str(step_dir(step))))
    folder = tmp_path / "run"
    run = [*TINY, *flags, "--max_steps", "2", "--save_every", "1", "--save_dir", str(folder)]
    run += ["--low_disk", "skip_save", "--eval_every", "0", "--sample_tokens", "0"]
    result = run_step(
        step,
        [*run, "--num_proc", "1"],
        nproc=2,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        script=str(launcher),
    )
    check(result)
    needed = re.search(r"step 1 needs about ([\d,]+) bytes", result.stdout + result.stderr)
    assert needed, result.stdout + result.stderr
    predicted = int(needed.group(1).replace(",", ""))
    files = list((folder / "step_000002").glob("*.safetensors"))
    written = sum(path.stat().st_size for path in files)
    print(f"\n{step} {name}: predicted {predicted:,} bytes, the files hold {written:,}")
    assert abs(predicted - written) <= 0.01 * written, (predicted, written)
