"""Start from a transformers Llama checkpoint (`--init_from_hf FOLDER`, as save_pretrained writes
it): the shape from its config.json, and each rank's parameters read from its safetensors files,
only the part of each tensor this rank holds (its stage's layers, its tp slices)."""

from pathlib import Path

import torch
from safetensors import safe_open

from checkpoint import LM_HEAD, cut, end, local_parameters, model_shapes, stored_name
from flags import OVERRIDES
from utils import log


def add_init_flag(parser):
    group = parser.add_argument_group("starting from a transformers checkpoint")
    group.add_argument(
        "--init_from_hf", help="start from a transformers Llama folder (safetensors)"
    )


def check_init_flag(parser, args):
    """Refuse, before anything runs, a folder that cannot be a transformers checkpoint."""
    if not args.init_from_hf:
        return
    if any(getattr(args, name) is not None for name in OVERRIDES):
        parser.error("--init_from_hf takes the model's shape from its config.json: no overrides")
    folder = Path(args.init_from_hf)
    if not folder.is_dir():
        parser.error(f"--init_from_hf {folder}: no such folder")
    if not (folder / "config.json").is_file():
        parser.error(f"--init_from_hf {folder}: no config.json (save_pretrained writes one)")
    if not list(folder.glob("*.safetensors")):
        parser.error(
            f"--init_from_hf {folder}: no *.safetensors weights (save_pretrained with "
            f"safe_serialization=True writes them)"
        )


def config_flag(args):
    """The flag whose folder the model's config comes from."""
    return "--init_from_hf" if args.init_from_hf else "--model_name"


def init_from_hf(model, args, resuming):
    """With --init_from_hf, fill the model from the folder, unless the run resumes: a job that
    starts from the folder, started again, goes on from its checkpoint."""
    if not args.init_from_hf:
        return
    if resuming:
        log(f"--init_from_hf {args.init_from_hf}: not loaded, the run resumes from its checkpoint")
        return
    load_hf_weights(model, args.init_from_hf)
    log(f"weights from {args.init_from_hf}")


def refuse_unused_tensors(expected, keys, directory):
    """A checkpoint tensor that no parameter of the whole model (`expected`: every stage's names)
    takes, such as a bias, would be dropped without a word: the run would train another model
    than the one saved."""
    # Older conversions saved RoPE's frequencies, which the model computes from the config.
    unused = sorted(k for k in set(keys) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ValueError(
            f"--init_from_hf {directory}: the model has no parameter for the checkpoint's "
            f"{', '.join(unused[:5])}{more}; was it saved from the model its config.json describes?"
        )


@torch.no_grad()
def load_hf_weights(model, directory):
    """Fill this rank's parameters from a transformers checkpoint, reading from the safetensors
    files only the box of each tensor this rank holds (its stage's layers, its tp slices). Every
    rank first checks the names and shapes of the whole model's parameters (every stage's), so
    that all refuse alike, before any weight is read."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"--init_from_hf {directory}: no *.safetensors files there")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {key: handle for handle in handles for key in handle.keys()}
    # A tied lm_head is the embedding, which transformers saves (and the head too, at times).
    shapes, tied = model_shapes(model), model.config.tie_word_embeddings
    refuse_unused_tensors([*shapes, *([LM_HEAD] if tied else [])], where, directory)
    for key, shape in shapes.items():
        if key not in where:
            raise ValueError(f"--init_from_hf {directory}: no tensor {key}")
        found = where[key].get_slice(key).get_shape()
        if found != shape:
            raise ValueError(
                f"--init_from_hf {directory}: {key} has shape {tuple(found)}, "
                f"this model's is {tuple(shape)}"
            )
    for placed, start in local_parameters(model):
        key = stored_name(placed.name, model.config)
        box = {"start": start, "size": list(placed.param.shape)}  # this rank's, of the whole one
        full = where[key].get_slice(key)
        placed.param.copy_(full[cut(start, end(box), [0] * len(start))])
