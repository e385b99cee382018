"""Checkpoints that resume in any parallel layout, and survive a crash.

A checkpoint is a folder `step_000100/`, written under a temporary name and renamed only when
complete; the `latest` file is replaced the same way, so a crash mid-save leaves the previous
checkpoint as it was.

Each (pipeline stage, tensor-parallel rank) writes the slices it holds, under the one-device
model's names: the weights in model-pp0-of-2-tp1-of-2.safetensors, their AdamW state (exp_avg
and exp_avg_sq, split like the weight, and the step count) in optimizer-pp0-of-2-tp1-of-2...;
a weight that every tp rank holds whole (the RMSNorm weights) is written once. `index.json`
records where each slice sits in the full tensor:

    "model.layers.0.self_attn.q_proj.weight": {"shape": [64, 64], "dim": 0, "pieces": [
        {"file": "model-pp0-of-2-tp0-of-2.safetensors", "start": 0, "size": 32},
        {"file": "model-pp0-of-2-tp1-of-2.safetensors", "start": 32, "size": 32}]}

A rank of any other layout knows which rows (or columns) of which tensors it holds, and reads
just those from the files that have them (safe_open + get_slice: no rank loads a whole file).
trainer_state.pt holds the rest, which is global: the step, the learning-rate schedule, the data
position (rows served to all replicas) and the global batch it was counted in.
"""

import json
import os
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from model import LlamaForCausalLM
from pipeline_parallel import check_pipeline_parallel
from placement import placed_parameters, starts
from tensor_parallel import check_tensor_parallel
from utils import log

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
MOMENTS = ["exp_avg", "exp_avg_sq"]  # AdamW's, shaped and split like their parameter


def local_parameters(model):
    """This rank's parameters, each once (a shared one under its first name), as (name,
    parameter, dim, start, full shape), from each one's placement: the parameter is [start, start
    + its size) along `dim` of the full tensor, or all of it when dim is None."""
    for placed in placed_parameters(model):
        first = starts(placed.param.shape, placed.record)
        assert len(first) <= 1, f"{placed.name}: the index holds one split dim per tensor"
        dim, start = next(iter(first.items()), (None, 0))
        yield placed.name, placed.param, dim, start, placed.shape


def stored_name(name, config):
    # A tied lm_head is the embedding: one parameter at pp 1, a copy on the last stage at pp > 1.
    return EMBED if name == LM_HEAD and config.tie_word_embeddings else name


def narrow(tensor_slice, dim, start, size):
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a safetensors slice, read alone."""
    if dim == 0:
        return tensor_slice[start : start + size]
    return tensor_slice[:, start : start + size]


def write_atomically(path, text):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one


def shard_name(pgm):
    return f"pp{pgm.pp_rank}-of-{pgm.pp_size}-tp{pgm.tp_rank}-of-{pgm.tp_size}"


def save_checkpoint(save_dir, step, model, optimizer, scheduler, loader, pgm, batch):
    """Called on every rank. Each (stage, tp rank) of replica 0 writes its slices, rank 0 the
    index and the trainer state, then renames. `batch`: the sizes that make the global batch."""
    save_dir = Path(save_dir)
    final, tmp = save_dir / f"step_{step:06d}", save_dir / f".step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.config.save_pretrained(tmp)  # the full model's shape, for export and sampling
    dist.barrier()
    pieces = write_slices(tmp, model, optimizer, pgm) if pgm.dp_rank == 0 else []
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everyone, dst=0)  # rank 0 goes on once every file is written
    if dist.get_rank() == 0:
        layout = {"tp_size": pgm.tp_size, "pp_size": pgm.pp_size, "dp_size": pgm.dp_size}
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


def write_slices(folder, model, optimizer, pgm):
    """Write this rank's weights and their AdamW state; returns one index entry per tensor:
    (section, name, full shape, dim, file, start, size)."""
    tensors, pieces = {"model": {}, "optimizer": {}}, []

    def add(section, name, tensor, dim, start, shape):
        tensors[section][name] = tensor.detach().contiguous()
        size = None if dim is None else tensor.shape[dim]
        file = f"{section}-{shard_name(pgm)}.safetensors"
        pieces.append((section, name, shape, dim, file, start, size))

    for name, param, dim, start, shape in local_parameters(model):
        if stored_name(name, model.config) != name:
            continue  # the tied copy on the last stage: the first stage stores the embedding
        if dim is None and pgm.tp_rank != 0:
            continue  # the same on every tp rank: tp rank 0 stores it
        state = optimizer.state[param]
        add("model", name, param, dim, start, shape)
        for moment in MOMENTS:
            add("optimizer", f"{name}.{moment}", state[moment], dim, start, shape)
        if pgm.tp_rank == 0:  # the step count is the same for every slice
            add("optimizer", f"{name}.step", state["step"], None, 0, [])
    for section, named in tensors.items():
        path = folder / f"{section}-{shard_name(pgm)}.safetensors"
        save_file(named, path)
        # safetensors creates its file 0600 (a temporary file, renamed): make it as readable as
        # config.json beside it, so whoever may read the checkpoint may read its weights.
        shutil.copymode(folder / "config.json", path)
    return pieces


def build_index(everyone):
    """{section: {name: {shape, dim, pieces}}} from every rank's entries; the pieces of a split
    tensor must tile it exactly."""
    index = {"model": {}, "optimizer": {}}
    for section, name, shape, dim, file, start, size in (p for rank in everyone for p in rank):
        entry = index[section].setdefault(name, {"shape": shape, "dim": dim, "pieces": []})
        entry["pieces"].append({"file": file, "start": start, "size": size})
    for entry in (e for section in index.values() for e in section.values()):
        entry["pieces"].sort(key=lambda piece: piece["start"])
        if entry["dim"] is None:
            assert len(entry["pieces"]) == 1, entry
        else:
            ends = [p["start"] + p["size"] for p in entry["pieces"]]
            assert [p["start"] for p in entry["pieces"]] == [0, *ends[:-1]], entry
            assert ends[-1] == entry["shape"][entry["dim"]], entry
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


def check_checkpoint(path, config):
    """Refuse, before any weight is read, a checkpoint that this model cannot resume from: one
    of the earlier layout-locked format, one of another model, one with a file missing or cut
    short. Returns its index."""
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
    with torch.device("meta"):  # shapes only, no memory
        full = {name: list(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        del full[LM_HEAD]
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
    missing = [f"{name}.{s}" for name in full for s in [*MOMENTS, "step"]]
    missing = [key for key in missing if key not in index["optimizer"]]
    if missing:
        raise ValueError(f"{path}/index.json has no optimizer state {short(missing)}")
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
def load_checkpoint(path, index, model, optimizer, scheduler, loader):
    """Restore what `save_checkpoint` wrote, in this rank's layout, reading only this rank's
    slices. Returns the step and the global batch it was saved at."""
    path, handles = Path(path), {}

    def read(section, name, dim, start, size):
        entry, parts = index[section][name], []
        for piece in entry["pieces"]:
            if piece["file"] not in handles:
                handles[piece["file"]] = safe_open(path / piece["file"], framework="pt")
            handle = handles[piece["file"]]
            if dim is None:
                return handle.get_tensor(name)  # not split: one piece, the whole tensor
            assert entry["dim"] == dim, (name, entry["dim"], dim)
            lo, hi = max(start, piece["start"]), min(start + size, piece["start"] + piece["size"])
            if lo < hi:  # this piece holds some of the rows (columns) this rank needs
                parts.append(narrow(handle.get_slice(name), dim, lo - piece["start"], hi - lo))
        return torch.cat(parts, dim)

    state = optimizer.state_dict()  # this layout's parameter groups; the state is filled below
    params = [p for group in optimizer.param_groups for p in group["params"]]
    position = {id(p): i for i, p in enumerate(params)}  # how state_dict() numbers them
    for name, param, dim, start, _ in local_parameters(model):
        key, size = stored_name(name, model.config), None if dim is None else param.shape[dim]
        param.copy_(read("model", key, dim, start, size))
        moments = {m: read("optimizer", f"{key}.{m}", dim, start, size) for m in MOMENTS}
        step = read("optimizer", f"{key}.step", None, 0, None)
        state["state"][position[id(param)]] = {"step": step, **moments}
    optimizer.load_state_dict(state)  # moves each tensor to its parameter's device
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


def check_resume(path, config, args):
    """The checkpoint to resume (from `find_checkpoint`) and its index, checked against this model
    and layout before any weight exists; None to start from step 0."""
    if path is None:
        return None
    index = check_checkpoint(path, config)
    try:  # build_model checks the same, but here the message can say what would work
        check_tensor_parallel(config, args.tp_size)
        check_pipeline_parallel(config, args.pp_size)
    except ValueError as error:
        tp_sizes = [t for t in range(1, config.num_attention_heads + 1) if valid_tp(config, t)]
        raise ValueError(
            f"cannot resume {path} at tp {args.tp_size} x pp {args.pp_size}: {error}. This "
            f"model takes tp_size in {tp_sizes} and pp_size up to {config.num_hidden_layers}"
        ) from error
    return path, index


def valid_tp(config, tp_size):
    try:
        check_tensor_parallel(config, tp_size)
    except ValueError:
        return False
    return True


def resume(checkpoint, model, optimizer, scheduler, loader, args, pgm):
    """Load the checkpoint into this layout, whatever layout saved it; returns its step."""
    path, index = checkpoint
    step, saved = load_checkpoint(path, index, model, optimizer, scheduler, loader)
    layouts = [
        " x ".join(f"{axis} {sizes[f'{axis}_size']}" for axis in ["tp", "pp", "dp"])
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
