"""Checkpoints that resume in any parallel layout, and survive a crash.

A checkpoint is a folder `step_000100/`, written under a temporary name and renamed only when
complete; the `latest` file is replaced the same way, so a crash mid-save leaves the previous
checkpoint as it was.

Each rank writes the pieces it holds, under the one-device model's names: the weights in
model-pp0-of-2-tp1-of-2.safetensors, their AdamW state (exp_avg and exp_avg_sq, split like the
weight, and the step count) in optimizer-pp0-of-2-tp1-of-2...; the file's name gives the rank's
place on the axes its parameters are spread over. A piece that several ranks hold (on every
replica; an RMSNorm weight on every tp rank) is written once. `index.json` records the box that
each piece fills in the full tensor, a start and a size per dim:

    "model.layers.0.self_attn.q_proj.weight": {"shape": [64, 64], "pieces": [
        {"file": "model-pp0-of-2-tp0-of-2.safetensors", "start": [0, 0], "size": [32, 64]},
        {"file": "model-pp0-of-2-tp1-of-2.safetensors", "start": [32, 0], "size": [32, 64]}]}

A rank of any other layout knows from each parameter's placement record which box of the tensor
it holds, and reads from every piece that overlaps it just the overlap (safe_open + get_slice:
no rank loads a whole file).
trainer_state.pt holds the rest, which is global: the step, the learning-rate schedule, the data
position (rows served to all replicas) and the global batch it was counted in.

With ZeRO-1 each dp rank holds the AdamW state of its shard only: the moments are put together
whole before the save and cut into this layout's shards after the load (zero.py), so the files
are step 9's, and a run resumes with any dp_size and bucket size.
"""

import json
import math
import os
import shutil
import zipfile
from itertools import combinations
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from placement import Held, placed_parameters, starts
from process_group_manager import AXES
from utils import log

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# AdamW's and Muon's (muon.py), shaped and split like their parameter; each has some of them.
MOMENTS = ["exp_avg", "exp_avg_sq", "momentum_buffer"]


def local_parameters(model):
    """This rank's parameters, each once (a shared one under its first name), as (Placed, start),
    from each one's placement: the parameter is the box [start, start + its shape) of the full
    tensor, one start per dim."""
    for placed in placed_parameters(model):
        first = starts(placed.param.shape, placed.record)
        yield placed, [first.get(dim, 0) for dim in range(placed.param.ndim)]


def stored_name(name, config):
    # A tied lm_head is the embedding: one parameter at pp 1, a copy on the last stage at pp > 1.
    return EMBED if name == LM_HEAD and config.tie_word_embeddings else name


def overlap(a, b):
    """Where the boxes a and b ({"start", "size"}: one each per dim) meet: (lo, hi) per dim, or
    None. Two scalars (no dims) always meet."""
    lo = [max(s, t) for s, t in zip(a["start"], b["start"], strict=True)]
    hi = [min(s, t) for s, t in zip(end(a), end(b), strict=True)]
    return (lo, hi) if all(x < y for x, y in zip(lo, hi, strict=True)) else None


def end(box):
    return [s + n for s, n in zip(box["start"], box["size"], strict=True)]


def cut(lo, hi, origin):
    """The index of [lo, hi) (per dim) in a box that starts at `origin` of the full tensor."""
    return tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, origin, strict=True))


def read_box(pieces, box, open_slice):
    """The `box` of a tensor, from the `pieces` that tile it: each piece that overlaps the box is
    read only where it does (`open_slice(piece)`: its safetensors slice), into its place."""
    out, filled = None, 0
    for piece in pieces:
        if (meet := overlap(box, piece)) is None:
            continue
        part = open_slice(piece)[cut(*meet, piece["start"])]
        if out is None:
            out = torch.empty(box["size"], dtype=part.dtype)
        out[cut(*meet, box["start"])] = part
        filled += part.numel()
    assert filled == math.prod(box["size"]), (filled, box)
    return out


def write_atomically(path, text):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one


def file_name(section, model, pgm):
    """`section`-pp0-of-2-tp1-of-2.safetensors: this rank's coordinate on each axis that its
    parameters are spread over, in grid order. A rank off coordinate 0 of an axis writes only
    pieces spread over it (`writes`), so no two ranks that write share a name; parameters spread
    over another axis (dp, when a technique splits them there) put it in the name."""
    spread = set().union(*(placed.axes for placed in placed_parameters(model)))
    axes = [axis for axis in AXES if axis in spread]
    where = [f"{a}{getattr(pgm, f'{a}_rank')}-of-{getattr(pgm, f'{a}_size')}" for a in axes]
    return "-".join([section, *where]) + ".safetensors"


def writes(pgm, spread):
    """Whether this rank writes a piece spread over the axes `spread` (`Placed.axes`): of the
    ranks that hold the same piece, the one at coordinate 0 of every other axis, the one that
    `grad_norm` counts it on (replica 0; tp rank 0 for a weight whole on every tp rank)."""
    return all(getattr(pgm, f"{axis}_rank") == 0 for axis in AXES if axis not in spread)


def save_checkpoint(ctx, state, step):
    """Called on every rank, with the run's context and what it trains (train.py's `Context` and
    `State`). Each rank writes the pieces that fall to it, rank 0 the index and the trainer
    state, then renames."""
    save_dir, model, pgm = Path(ctx.args.save_dir), state.model, ctx.pgm
    optimizer, scheduler, loader = state.optimizer, state.scheduler, state.train_loader
    batch = global_batch(ctx.args, pgm)  # saved with the checkpoint, for a resume to compare
    zero = state.wrapped  # ZeRO-1: it puts the optimizer state together from the dp ranks
    final, tmp = save_dir / f"step_{step:06d}", save_dir / f".step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.config.save_pretrained(tmp)  # the full model's shape, for export and sampling
    dist.barrier()
    moments = zero.gather_optimizer_state(optimizer)  # every dp rank takes part
    pieces = write_slices(tmp, model, moments, pgm)
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everyone, dst=0)  # rank 0 goes on once every file is written
    if dist.get_rank() == 0:
        layout = {"tp_size": pgm.tp_size, "pp_size": pgm.pp_size, "dp_size": pgm.dp_size}
        layout["cp_size"] = pgm.cp_size
        index = {"layout": layout, **build_index(everyone)}
        write_index(tmp / "index.json", index)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()  # rank 0's device
        state = {"step": step, "scheduler": scheduler.state_dict(), "data": loader.state_dict()}
        state.update(batch=batch, rng=rng)
        torch.save(state, tmp / "trainer_state.pt")
        if final.exists():  # saving the same step again, after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomically(save_dir / "latest", final.name)
    dist.barrier()  # no rank runs ahead of a checkpoint being written
    log(f"saved {final}")
    return final


def checkpoint_bytes(model, pgm, moments=2):
    """The bytes of the weights and their optimizer state that this rank writes (`write_slices`):
    each piece on the one rank that writes it, so that their sum over the ranks is the
    checkpoint's in any layout (ZeRO's shards of the optimizer state are put together before the
    save). `moments` per weight: AdamW's two (Muon's matrices hold one: then an upper bound)."""
    return sum(
        (1 + moments) * placed.param.numel() * placed.param.element_size()
        for placed, _ in local_parameters(model)
        if writes(pgm, placed.axes) and stored_name(placed.name, model.config) == placed.name
    )


def write_slices(folder, model, moments, pgm):
    """Write the pieces of the weights and of their AdamW state ({parameter: its whole state})
    that fall to this rank (`writes`); returns one index entry per piece: (section, name, full
    shape, {file, start, size})."""
    tensors, pieces = {"model": {}, "optimizer": {}}, []
    files = {section: file_name(section, model, pgm) for section in tensors}

    def add(section, name, tensor, shape, start):
        tensors[section][name] = tensor.detach().contiguous()
        box = {"file": files[section], "start": start, "size": list(tensor.shape)}
        pieces.append((section, name, shape, box))

    for placed, start in local_parameters(model):
        name, shape = placed.name, placed.shape
        if stored_name(name, model.config) != name:
            continue  # the tied copy on the last stage: the first stage stores the embedding
        state = moments[placed.param]
        if writes(pgm, placed.axes):  # of the ranks that hold this piece, the one that writes it
            add("model", name, placed.param, shape, start)
            for moment in (m for m in MOMENTS if m in state):
                add("optimizer", f"{name}.{moment}", state[moment], shape, start)
        # The step count, a scalar, is the same for every piece: spread over the Held axes only.
        if writes(pgm, {entry.axis for entry in placed.record if isinstance(entry, Held)}):
            add("optimizer", f"{name}.step", state["step"], [], [])
    for section, named in tensors.items():
        if not named:
            continue  # all this rank holds, another rank writes
        save_file(named, folder / files[section])
        # safetensors creates its file 0600 (a temporary file, renamed): make it as readable as
        # config.json beside it, so whoever may read the checkpoint may read its weights.
        shutil.copymode(folder / "config.json", folder / files[section])
    return pieces


def build_index(everyone):
    """{section: {name: {shape, pieces}}} from every rank's entries. The pieces of a tensor must
    tile it exactly: each inside it, no two overlapping, their volumes adding up to its own."""
    index = {"model": {}, "optimizer": {}}
    for section, name, shape, piece in (p for rank in everyone for p in rank):
        index[section].setdefault(name, {"shape": shape, "pieces": []})["pieces"].append(piece)
    for entry in (e for section in index.values() for e in section.values()):
        shape, pieces = entry["shape"], sorted(entry["pieces"], key=lambda p: p["start"])
        bounds = [zip(p["start"], end(p), shape, strict=True) for p in pieces]
        inside = all(0 <= s and e <= m for dims in bounds for s, e, m in dims)
        apart = not any(overlap(p, q) for p, q in combinations(pieces, 2))
        volume = sum(math.prod(p["size"]) for p in pieces)
        assert inside and apart and volume == math.prod(shape), entry
        entry["pieces"] = pieces
    return index


def write_index(path, index):
    """index.json with one line per tensor, for people to read too."""
    lines = [f'{{"layout": {json.dumps(index["layout"])},']
    for section, end in [("model", "},"), ("optimizer", "}}")]:
        entries = [f"  {json.dumps(name)}: {json.dumps(e)}" for name, e in index[section].items()]
        lines += [f' "{section}": {{', ",\n".join(entries), f" {end}"]
    path.write_text("\n".join(lines) + "\n")


def latest_checkpoint(save_dir):
    latest = Path(save_dir) / "latest"
    return Path(save_dir) / latest.read_text().strip() if latest.exists() else None


def check_checkpoint(path):
    """Refuse, before the model is built, a checkpoint that no run can resume from: one of the
    earlier layout-locked format, one with a file missing or cut short. Returns its index, each
    entry in boxes. Whether it holds this run's model is checked once the model exists
    (`check_model`)."""
    path = Path(path)
    if not (path / "index.json").is_file():
        if any(path.glob("trainer_state-*.pt")):
            raise ValueError(
                f"{path} is a checkpoint of the earlier format, one file per rank with no "
                f"index.json, which resumes only in its own layout with the trainer that wrote "
                f"it. To carry its weights over (the optimizer state, schedule and data position "
                f"start afresh): python tools/export_hf.py {path} {path}-hf, then train with "
                f"--init_from_hf {path}-hf"
            )
        raise ValueError(f"{path} has no index.json: it is not a checkpoint of this trainer")
    try:
        index = json.loads((path / "index.json").read_text())
    except ValueError as error:  # cut short, or edited by hand
        raise ValueError(f"{path}/index.json is not valid JSON ({error})") from error
    if not isinstance(index, dict) or not {"model", "optimizer"} <= index.keys():
        raise ValueError(f"{path}/index.json is not a checkpoint index (no model and optimizer)")
    for entry in (e for section in ["model", "optimizer"] for e in index[section].values()):
        if "dim" in entry:  # written before the index held boxes
            as_boxes(entry)
    for file, names in files_of(index).items():
        if not (path / file).is_file():
            raise ValueError(f"{path} is incomplete: {file} is missing")
        try:
            with safe_open(path / file, framework="pt") as handle:
                absent = names - set(handle.keys())
        except Exception as error:  # safetensors checks the header and the file's length
            raise ValueError(f"{path / file} cannot be read ({error})") from error
        if absent:
            raise ValueError(f"{path / file} lacks {short(absent)}, which index.json puts there")
    if not (path / "trainer_state.pt").is_file():
        raise ValueError(f"{path} is incomplete: trainer_state.pt is missing")
    try:  # the zip index at the end of a torch.save file: gone when the file is cut short
        zipfile.ZipFile(path / "trainer_state.pt").close()
    except (OSError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path}/trainer_state.pt is truncated or damaged ({error})") from error
    return index


def as_boxes(entry):
    """An entry of the earlier index, split along one "dim" (None: one piece, the whole tensor)
    with a "start" and a "size" along it, given a box per piece instead."""
    dim, shape = entry.pop("dim"), entry["shape"]
    for piece in entry["pieces"]:
        start, size = [0] * len(shape), list(shape)
        if dim is not None:
            start[dim], size[dim] = piece["start"], piece["size"]
        piece.update(start=start, size=size)


def model_shapes(model):
    """{name: full shape} of every parameter of the model this run built, every stage's (each
    rank's own, gathered), under the names a checkpoint stores them by."""
    mine = {stored_name(p.name, model.config): p.shape for p in placed_parameters(model)}
    everyone = [mine]
    if dist.is_initialized():  # else one process holds the whole model (a test)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {name: shape for shapes in everyone for name, shape in shapes.items()}


def check_model(path, index, model, optimizer):
    """Refuse, before any weight is read, a checkpoint of another model than the one this run
    built: its parameters' names and full shapes, every stage's, against those in the index;
    and one of another optimizer (AdamW and Muon keep other state). Every rank compares the
    same, so every rank refuses alike."""
    config, full = model.config, model_shapes(model)
    saved = {name: entry["shape"] for name, entry in index["model"].items()}
    if saved != full:
        different = sorted(k for k in saved.keys() & full.keys() if saved[k] != full[k])
        raise ValueError(
            f"{path} holds another model than this one ({config.num_hidden_layers} layers, "
            f"hidden_size {config.hidden_size}, intermediate_size {config.intermediate_size}, "
            f"{config.num_attention_heads} heads, {config.num_key_value_heads} key/value heads, "
            f"vocab_size {config.vocab_size}, tie_word_embeddings "
            f"{config.tie_word_embeddings}): missing {short(full.keys() - saved.keys())}, "
            f"unexpected {short(saved.keys() - full.keys())}, other shapes "
            f"{short(f'{k} {saved[k]} instead of {full[k]}' for k in different)}; resume with "
            f"the --model_name and overrides it was trained with"
        )
    trained, this = [
        "muon" if muon else "adamw"
        for muon in [
            any(key.endswith(".momentum_buffer") for key in index["optimizer"]),
            any(group.get("muon") for group in optimizer.param_groups),
        ]
    ]
    if trained != this:
        raise ValueError(
            f"{path} was trained with --optimizer {trained}, this run has --optimizer {this}: "
            f"resume it with --optimizer {trained}"
        )
    kept = state_names(optimizer)
    missing = [f"{name}.{s}" for name in full for s in [*kept(name, len(full[name])), "step"]]
    missing = [key for key in missing if key not in index["optimizer"]]
    if missing:
        raise ValueError(f"{path}/index.json has no optimizer state {short(missing)}")


def state_names(optimizer):
    """What `optimizer` keeps for a parameter, `(name, ndim) -> [state names]`, as muon.py's
    make_optimizer says; a plain AdamW (a test's) keeps its two moments."""
    return getattr(optimizer, "state_names", lambda name, ndim: ["exp_avg", "exp_avg_sq"])


def files_of(index):
    """{file: the names index.json puts in it}."""
    files = {}
    for section in ["model", "optimizer"]:
        for name, entry in index[section].items():
            for piece in entry["pieces"]:
                files.setdefault(piece["file"], set()).add(name)
    return files


def short(items, limit=6):
    items = sorted(items)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return "[" + ", ".join(items[:limit]) + more + "]"


@torch.no_grad()
def read_parameters(path, index, model):
    """Fill this rank's parameters from the checkpoint at `path`, each with the box of the full
    tensor that it holds, and return their AdamW state, read the same way: {parameter: state}."""
    handles, states = {}, {}

    def read(section, name, box):
        def open_slice(piece):
            if piece["file"] not in handles:
                handles[piece["file"]] = safe_open(path / piece["file"], framework="pt")
            return handles[piece["file"]].get_slice(name)

        return read_box(index[section][name]["pieces"], box, open_slice)

    for placed, start in local_parameters(model):
        key = stored_name(placed.name, model.config)
        box = {"start": start, "size": list(placed.param.shape)}
        placed.param.copy_(read("model", key, box))
        saved = [m for m in MOMENTS if f"{key}.{m}" in index["optimizer"]]  # checked: its own
        held = {m: read("optimizer", f"{key}.{m}", box) for m in saved}
        step = read("optimizer", f"{key}.step", {"start": [], "size": []})  # a scalar
        states[placed.param] = {"step": step, **held}
    return states


@torch.no_grad()
def load_checkpoint(path, index, model, optimizer, scheduler, loader, zero):
    """Restore what `save_checkpoint` wrote, in this rank's layout, reading only this rank's
    pieces; `zero` gives this dp rank its shard of the AdamW state. Returns the step and the
    global batch it was saved at."""
    path = Path(path)
    check_model(path, index, model, optimizer)  # on every rank, before any weight is read
    whole = read_parameters(path, index, model)  # parameter: its whole AdamW state
    zero.load_optimizer_state(optimizer, whole)  # this dp rank's shard of it
    trainer = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(trainer["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # the scheduler's state alone does not set the optimizer's rate
    loader.load_state_dict(trainer["data"])
    # Every rank gets rank 0's random state (all ranks seed alike), whatever the layout.
    torch.set_rng_state(trainer["rng"]["cpu"])
    if "cuda" in trainer["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(trainer["rng"]["cuda"])  # this rank's device
    return trainer["step"], trainer["batch"]


def check_resume(path, config, args, check_layout):
    """The checkpoint to resume (from `find_checkpoint`) and its index, checked before any weight
    exists: its files, and this layout against the config (the parameters are compared once the
    model is built: `check_model`); None to start from step 0. `check_layout(config, tp_size,
    pp_size)`: the step's refusal of a layout the model cannot take (train.py's)."""
    if path is None:
        return None
    index = check_checkpoint(path)
    try:  # build_model checks the same, but here the message can say what would work
        check_layout(config, args.tp_size, args.pp_size)
    except ValueError as error:
        heads = range(1, config.num_attention_heads + 1)
        tp_sizes = [t for t in heads if valid_tp(check_layout, config, t)]
        raise ValueError(
            f"cannot resume {path} at tp {args.tp_size} x pp {args.pp_size}: {error}. This "
            f"model takes tp_size in {tp_sizes} and pp_size up to {config.num_hidden_layers}"
        ) from error
    return path, index


def valid_tp(check_layout, config, tp_size):
    try:
        check_layout(config, tp_size, 1)
    except ValueError:
        return False
    return True


def resume(ctx, state, checkpoint):
    """Load the checkpoint into this layout, whatever layout saved it; returns its step."""
    args, pgm, model, zero = ctx.args, ctx.pgm, state.model, state.wrapped
    optimizer, scheduler, loader = state.optimizer, state.scheduler, state.train_loader
    path, index = checkpoint
    step, saved = load_checkpoint(path, index, model, optimizer, scheduler, loader, zero)
    layouts = [
        # Earlier steps' checkpoints have no cp_size: they were written at cp 1.
        " x ".join(f"{axis} {sizes.get(f'{axis}_size', 1)}" for axis in ["tp", "pp", "dp", "cp"])
        for sizes in [index["layout"], vars(pgm)]
    ]
    log(f"resumed from {path} at step {step}: saved at {layouts[0]}, running at {layouts[1]}")
    batch = global_batch(args, pgm)
    if rows_per_step(batch) != rows_per_step(saved) or batch["seq_len"] != saved["seq_len"]:
        # The data position counts rows, so the run goes on from there with other batches.
        sizes = [
            f"{rows_per_step(b)} rows "
            f"({b['micro_batch_size']} x {b['gradient_accumulation_steps']} x {b['dp_size']}) "
            f"of {b['seq_len']} tokens"
            for b in [saved, batch]
        ]
        log(
            f"the global batch (micro_batch_size x gradient_accumulation_steps x dp_size) "
            f"changes from {sizes[0]} to {sizes[1]}; training goes on from row "
            f"{loader.position:,} of the data"
        )
    return step


def rows_per_step(batch):
    return batch["micro_batch_size"] * batch["gradient_accumulation_steps"] * batch["dp_size"]


def global_batch(args, pgm):
    """The sizes that make one step's batch, saved with every checkpoint."""
    return {
        "micro_batch_size": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "dp_size": pgm.dp_size,
        "seq_len": args.seq_len,
    }
