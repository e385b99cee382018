"""Checkpoints that survive a crash and resume a run exactly.

A checkpoint is a folder `step_000100/` holding the model's config.json, the weights (safetensors)
and, beside them, the optimizer, the learning-rate schedule, the random-number generators and the
data position. It is written under a temporary name and renamed only when complete, and the
`latest` file is replaced the same way, so a crash mid-save leaves the previous checkpoint as it
was. Before anything is loaded, every file of the checkpoint is checked to be there and readable.

With tensor parallelism each rank holds a slice of the weights and of the optimizer state, so
every tensor-parallel rank writes its own shard (`model-tp1-of-2.safetensors`), and a run resumes
in the layout it was saved with.
"""

import os
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from transformers import LlamaConfig

from utils import log


def write_atomically(path, text):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one


def shard_name(pgm):
    return f"tp{pgm.tp_rank}-of-{pgm.tp_size}"


def save_checkpoint(ctx, state, step):
    """Called on every rank, with the run's context and what it trains (train.py's `Context` and
    `State`). Each tensor-parallel rank writes its shard, then rank 0 renames."""
    save_dir, model, pgm = Path(ctx.args.save_dir), state.model, ctx.pgm
    final, tmp = save_dir / f"step_{step:06d}", save_dir / f".step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.config.save_pretrained(tmp)  # the full model's shape, for export and sampling
    dist.barrier()
    if pgm.dp_rank == 0:  # any other replicas hold the same shards
        parts = state.optimizer, state.scheduler, state.train_loader
        write_state(tmp, shard_name(pgm), step, model, *parts)
    dist.barrier()  # every shard is complete before the folder becomes the latest checkpoint
    if dist.get_rank() == 0:
        if final.exists():  # saving the same step again, after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomically(save_dir / "latest", final.name)
    dist.barrier()  # no rank runs ahead of a checkpoint being written
    log(f"saved {final}")
    return final


def write_state(folder, shard, step, model, optimizer, scheduler, loader):
    save_model(model, str(folder / f"model-{shard}.safetensors"))  # handles tied embeddings
    # safetensors creates its file 0600 (a temporary file, renamed): make it as readable as
    # config.json beside it, so whoever may read the checkpoint may read its weights.
    shutil.copymode(folder / "config.json", folder / f"model-{shard}.safetensors")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "data": loader.state_dict(),
        "rng": rng,
    }
    torch.save(state, folder / f"trainer_state-{shard}.pt")


def latest_checkpoint(save_dir):
    latest = Path(save_dir) / "latest"
    return Path(save_dir) / latest.read_text().strip() if latest.exists() else None


def check_complete(path, files):
    """Refuse a checkpoint with a file missing, truncated or damaged, before any weight is loaded.
    Every rank checks every file, not only its own, so all ranks refuse it together."""
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist (named by {path.parent / 'latest'})")
    for name in files:
        if not (path / name).is_file():
            raise ValueError(f"checkpoint {path} is incomplete: it has no {name}")
        try:  # reads only the safetensors header, or the zip index at the end of a torch.save file
            if name.endswith(".safetensors"):
                with safe_open(str(path / name), framework="pt") as weights:
                    weights.keys()
            else:
                zipfile.ZipFile(path / name).close()
        except (OSError, SafetensorError, zipfile.BadZipFile) as error:
            raise ValueError(
                f"checkpoint {path}: {name} is truncated or damaged ({error})"
            ) from error


# What makes a model's weights fit another's: a checkpoint must agree on all of these.
MODEL_SHAPE = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
]


def check_same_model(path, config):
    """Refuse a checkpoint of another model (a run with other --model_name or overrides), by its
    config.json, before any weight is read."""
    if not (path / "config.json").is_file():
        return  # an older checkpoint: loading its weights will tell
    try:
        saved = LlamaConfig.from_pretrained(path)
    except (OSError, ValueError) as error:  # not JSON (cut short, edited by hand), or no config
        raise ValueError(f"checkpoint {path}: config.json cannot be read ({error})") from error
    different = [
        f"{key} {getattr(saved, key)} (this run: {getattr(config, key)})"
        for key in MODEL_SHAPE
        if getattr(saved, key) != getattr(config, key)
    ]
    if different:
        raise ValueError(
            f"checkpoint {path} holds another model: {', '.join(different)}; resume with the "
            f"--model_name and overrides it was trained with"
        )


def check_same_optimizer(path, groups, optimizer):
    """Refuse a checkpoint of AdamW in a run of Muon, and the other way: their state differs."""
    trained = "muon" if any(group.get("muon") for group in groups) else "adamw"
    if trained != optimizer:
        raise ValueError(
            f"checkpoint {path} was trained with --optimizer {trained}, this run has --optimizer "
            f"{optimizer}: resume it with --optimizer {trained}"
        )


def load_checkpoint(ctx, state, path):
    """Restore everything `save_checkpoint` wrote; returns the step it was saved at."""
    path, shard, model, device = Path(path), shard_name(ctx.pgm), state.model, ctx.device
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, shard)  # every rank's shard, so that each rank checks them all
    if path.is_dir() and not any((path / f"model-{s}.safetensors").exists() for s in shards):
        saved = ", ".join(sorted(p.name for p in path.glob("model*.safetensors")))
        raise ValueError(
            f"{path} has no shard {shard} (it holds {saved}): resume with the parallel layout "
            f"the checkpoint was saved with"
        )
    files = [(f"model-{s}.safetensors", f"trainer_state-{s}.pt") for s in sorted(set(shards))]
    check_complete(path, [name for pair in files for name in pair])
    check_same_model(path, model.config)
    load_model(model, str(path / f"model-{shard}.safetensors"), device=str(device))
    saved = torch.load(path / f"trainer_state-{shard}.pt", map_location=device, weights_only=True)
    check_same_optimizer(path, saved["optimizer"]["param_groups"], ctx.args.optimizer)
    state.optimizer.load_state_dict(saved["optimizer"])
    state.scheduler.load_state_dict(saved["scheduler"])
    state.train_loader.load_state_dict(saved["data"])
    torch.set_rng_state(saved["rng"]["cpu"].cpu())
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in saved["rng"]["cuda"]])
    log(f"resumed from {path} at step {saved['step']}")
    return saved["step"]
