"""Checkpoints that survive a crash and resume a run exactly.

A checkpoint is a folder `step_000100/` holding the model's config.json, the weights (safetensors)
and, beside them, the optimizer, the learning-rate schedule, the random-number generators and the
data position. It is written under a temporary name and renamed only when complete, and the
`latest` file is replaced the same way, so a crash mid-save leaves the previous checkpoint as it
was.

With tensor and pipeline parallelism each rank holds a slice of the weights and of the optimizer
state, so every (pipeline stage, tensor-parallel rank) writes its own shard
(`model-pp0-of-2-tp1-of-2.safetensors`), and a run resumes in the layout it was saved with.

With ZeRO-1 the optimizer state is also split over the data-parallel ranks: every rank writes its
own (`trainer_state-pp0-of-2-tp1-of-2-dp1-of-2.pt`), and a run resumes with the same dp_size and
gradient buckets, which decide what each rank's share is.
"""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_model


def write_atomically(path, text):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one


def shard_name(pgm):
    return f"pp{pgm.pp_rank}-of-{pgm.pp_size}-tp{pgm.tp_rank}-of-{pgm.tp_size}"


def state_name(pgm):
    return f"{shard_name(pgm)}-dp{pgm.dp_rank}-of-{pgm.dp_size}"


def save_checkpoint(save_dir, step, model, optimizer, scheduler, loader, pgm):
    """Called on every rank. Each tensor-parallel rank writes its shard, then rank 0 renames."""
    save_dir = Path(save_dir)
    final, tmp = save_dir / f"step_{step:06d}", save_dir / f".step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.config.save_pretrained(tmp)  # the full model's shape, for export and sampling
    dist.barrier()
    write_state(tmp, pgm, step, model, optimizer, scheduler, loader)
    dist.barrier()  # every shard is complete before the folder becomes the latest checkpoint
    if dist.get_rank() == 0:
        if final.exists():  # saving the same step again, after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomically(save_dir / "latest", final.name)
    dist.barrier()  # no rank runs ahead of a checkpoint being written
    return final


def write_state(folder, pgm, step, model, optimizer, scheduler, loader):
    if pgm.dp_rank == 0:  # the other replicas hold the same weights
        save_model(model, str(folder / f"model-{shard_name(pgm)}.safetensors"))  # tied: once
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),  # this dp rank's shard of the moments
        "shard_sizes": shard_sizes(optimizer),
        "scheduler": scheduler.state_dict(),
        "data": loader.state_dict(),
        "rng": rng,
    }
    torch.save(state, folder / f"trainer_state-{state_name(pgm)}.pt")


def shard_sizes(optimizer):
    """The sizes of the pieces this rank updates, which tell how the buckets were split."""
    return [[p.numel() for p in group["params"]] for group in optimizer.param_groups]


def latest_checkpoint(save_dir):
    latest = Path(save_dir) / "latest"
    return Path(save_dir) / latest.read_text().strip() if latest.exists() else None


def load_checkpoint(path, model, optimizer, scheduler, loader, device, pgm):
    """Restore everything `save_checkpoint` wrote; returns the step it was saved at."""
    path, shard = Path(path), shard_name(pgm)
    if not (path / f"model-{shard}.safetensors").exists():
        saved = ", ".join(sorted(p.name for p in path.glob("model*.safetensors")))
        raise ValueError(
            f"{path} has no shard {shard} (it holds {saved}): resume with the parallel layout "
            f"the checkpoint was saved with"
        )
    state_file = path / f"trainer_state-{state_name(pgm)}.pt"
    if not state_file.exists():
        saved = ", ".join(sorted(p.name for p in path.glob(f"trainer_state-{shard}-*.pt")))
        raise ValueError(
            f"{path} has no optimizer state {state_file.name} (it holds {saved}): ZeRO-1 splits "
            f"the optimizer state over the dp ranks, so resume with the dp_size it was saved with"
        )
    state = torch.load(state_file, map_location=device, weights_only=True)
    if state["shard_sizes"] != shard_sizes(optimizer):
        raise ValueError(
            f"{state_file} holds the optimizer state of other shards than this run's: resume with "
            f"the --bucket_size_mb (and model) it was saved with, which decide the shards"
        )
    load_model(model, str(path / f"model-{shard}.safetensors"), device=str(device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["cpu"].cpu())
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng"]["cuda"]])
    return state["step"]
