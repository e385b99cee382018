"""Export a pico3d checkpoint of any parallel layout as a transformers Llama (or Mixtral) folder.

A checkpoint folder holds one safetensors file per shard of the model:

    model.safetensors                              one device (step 3; steps 1-2 save none)
    model-tp{t}-of-{T}.safetensors                 tensor-parallel rank t of T (steps 4-6)
    model-pp{p}-of-{P}-tp{t}-of-{T}.safetensors    pipeline stage p of P, tp rank t (steps 7-8)

Every file uses transformers' key names with global layer indices. Pipeline stages hold disjoint
sets of keys, so merging stages is a union; tensor-parallel ranks hold slices of the same keys, so
merging ranks is a concatenation along the dimension each weight was split on (SPLIT_DIM).

Steps 9-11's checkpoints (those with an index.json) name the same files, but the index says where
each piece of each tensor lies (its file, and the box it fills: a start and a size per dimension);
weights that every tp rank holds whole are stored once, and the optimizer's files beside them are
not read here.

    python tools/export_hf.py checkpoints/run out/hf --tokenizer tinytales
"""

import argparse
import copy
import json
import math
import re
import shutil
import sys
from contextlib import ExitStack
from itertools import product
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# The dimension tensor parallelism split each weight along, named by its module: 0 for the
# column-parallel layers (output features; the vocabulary for embed_tokens and lm_head), 1 for the
# row-parallel layers (input features), None for the RMSNorm weights, which every rank holds whole.
SPLIT_DIM = {
    "embed_tokens": 0,
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "gate_proj": 0,
    "up_proj": 0,
    "lm_head": 0,
    "o_proj": 1,
    "down_proj": 1,
    "input_layernorm": None,
    "post_attention_layernorm": None,
    "norm": None,
}
TP_NAME = re.compile(r"model-tp(\d+)-of-(\d+)\.safetensors")
PP_TP_NAME = re.compile(r"model-pp(\d+)-of-(\d+)-tp(\d+)-of-(\d+)\.safetensors")


def resolve_checkpoint(path):
    """The step folder itself, or the one that the `latest` file of a run folder names."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not path.is_dir():
        raise ValueError(f"no checkpoint folder at {path}")
    return path


def parse_shard_name(name):
    """(scheme, pp_rank, pp_size, tp_rank, tp_size) of a weight file, None for an unknown name."""
    if name == "model.safetensors":
        return "one", 0, 1, 0, 1
    if match := TP_NAME.fullmatch(name):
        return "tp", 0, 1, int(match[1]), int(match[2])
    if match := PP_TP_NAME.fullmatch(name):
        return ("pp", *(int(group) for group in match.groups()))
    return None


def shard_file_name(scheme, pp_rank, pp_size, tp_rank, tp_size):
    if scheme == "one":
        return "model.safetensors"
    if scheme == "tp":
        return f"model-tp{tp_rank}-of-{tp_size}.safetensors"
    return f"model-pp{pp_rank}-of-{pp_size}-tp{tp_rank}-of-{tp_size}.safetensors"


def describe_layout(pp_size, tp_size):
    if pp_size == 1:
        return "one device" if tp_size == 1 else f"tp {tp_size}"
    return f"pp {pp_size} x tp {tp_size}"


def find_shards(folder):
    """The layout of a checkpoint folder: (pp_size, tp_size, {(pp_rank, tp_rank): file}).
    Refuses a folder whose weight files do not make up exactly one complete layout."""
    names = sorted(path.name for path in folder.glob("model*.safetensors"))
    parsed = {name: parse_shard_name(name) for name in names}
    found = ", ".join(names)
    unknown = [name for name, fields in parsed.items() if fields is None]
    if not names:
        raise ValueError(f"{folder} holds no model*.safetensors weight file")
    if unknown:
        raise ValueError(f"{folder} holds weight files of no known layout: {found}")
    schemes = {fields[0] for fields in parsed.values()}
    sizes = {(pp_size, tp_size) for _, _, pp_size, _, tp_size in parsed.values()}
    if len(schemes) > 1 or len(sizes) > 1:
        raise ValueError(f"{folder} mixes weight files of different layouts: {found}")
    [scheme], [(pp_size, tp_size)] = schemes, sizes
    grid = product(range(pp_size), range(tp_size))
    expected = {shard_file_name(scheme, p, pp_size, t, tp_size) for p, t in grid}
    if set(names) != expected:
        missing = ", ".join(sorted(expected - set(names))) or "none"
        extra = ", ".join(sorted(set(names) - expected)) or "none"
        raise ValueError(
            f"{folder} is an incomplete {describe_layout(pp_size, tp_size)} checkpoint "
            f"({pp_size} x {tp_size} = {len(expected)} files): found {found}; "
            f"missing {missing}; out of range {extra}"
        )
    shards = {(p, t): folder / name for name, (_, p, _, t, _) in parsed.items()}
    return pp_size, tp_size, shards


def merge_tensor(key, pieces, files):
    """One full tensor from the tp ranks' pieces (in rank order) of the weight `key`."""
    if len(pieces) == 1:
        return pieces[0]
    module = key.split(".")[-2]  # model.layers.3.self_attn.q_proj.weight -> q_proj
    if not key.endswith(".weight") or module not in SPLIT_DIM:
        raise ValueError(f"no tensor-parallel rule for {key} (in {files[0].name})")
    dim = SPLIT_DIM[module]
    if dim is not None:
        return torch.cat(pieces, dim)
    for piece, file in zip(pieces[1:], files[1:], strict=True):
        if not torch.equal(piece, pieces[0]):
            difference = (piece.float() - pieces[0].float()).abs().max().item()
            raise ValueError(
                f"{key} is replicated on every tp rank, but {file.name} differs from "
                f"{files[0].name} (by up to {difference:.3g}): the ranks drifted apart in training"
            )
    return pieces[0]


def merge_shards(pp_size, tp_size, shards):
    """The union over pipeline stages of each stage's tensors, merged over its tp ranks."""
    state_dict, owner = {}, {}
    for p in range(pp_size):
        files = [shards[p, t] for t in range(tp_size)]
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
            keys = [set(handle.keys()) for handle in handles]
            for file, file_keys in zip(files[1:], keys[1:], strict=True):
                if file_keys != keys[0]:
                    only = sorted(file_keys ^ keys[0])
                    raise ValueError(
                        f"{file.name} and {files[0].name} are tp ranks of one stage but do not "
                        f"hold the same keys; only one of them holds {short_list(only)}"
                    )
            for key in sorted(keys[0]):
                if key in owner:
                    raise ValueError(f"{key} is in both {owner[key]} and {files[0].name}")
                owner[key] = files[0].name
                pieces = [handle.get_tensor(key) for handle in handles]
                state_dict[key] = merge_tensor(key, pieces, files)
    return state_dict


def read_indexed(folder):
    """The full weights of a checkpoint with an index.json: each tensor put together from its
    pieces, each in the box the index gives it. Returns (state dict, layout)."""
    try:
        index = json.loads((folder / "index.json").read_text())
    except ValueError as error:  # cut short, or edited by hand
        raise ValueError(f"{folder}/index.json is not valid JSON ({error})") from error
    files = {}
    for key, entry in index["model"].items():
        if "dim" in entry:  # written before the index held boxes
            as_boxes(entry)
        for piece in entry["pieces"]:
            files.setdefault(piece["file"], []).append(key)
    state_dict = {}
    for file, keys in sorted(files.items()):
        if not (folder / file).is_file():
            raise ValueError(f"{folder} is incomplete: {file} is missing")
        try:
            handle = safe_open(folder / file, framework="pt")
        except Exception as error:  # safetensors checks the header and the file's length
            raise ValueError(f"{folder / file} cannot be read ({error})") from error
        unlisted = sorted(set(handle.keys()) - set(keys))
        if unlisted:
            raise ValueError(
                f"{folder / file} holds tensors that index.json does not list: "
                f"{short_list(unlisted)}"
            )
        for key in keys:
            state_dict.setdefault(key, {})[file] = handle.get_tensor(key)
    for key, entry in index["model"].items():
        state_dict[key] = put_together(key, entry, state_dict[key])
    return state_dict, index["layout"]


def as_boxes(entry):
    """An entry of the earlier index, split along one "dim" (None: one piece, the whole tensor)
    with a "start" and a "size" along it, given a box per piece instead."""
    dim, shape = entry.pop("dim"), entry["shape"]
    for piece in entry["pieces"]:
        start, size = [0] * len(shape), list(shape)
        if dim is not None:
            start[dim], size[dim] = piece["start"], piece["size"]
        piece.update(start=start, size=size)


def put_together(key, entry, tensors):
    """The full tensor of an index entry, from its pieces ({file: tensor}) each put in its box."""
    shape, full, filled = entry["shape"], None, 0
    for piece in entry["pieces"]:
        tensor, start, size = tensors[piece["file"]], piece["start"], piece["size"]
        inside = all(0 <= s <= m - n for s, n, m in zip(start, size, shape, strict=True))
        if list(tensor.shape) != size or not inside:
            raise ValueError(
                f"{key}: {piece['file']} holds {list(tensor.shape)}, which index.json puts at "
                f"{start} of {shape} with size {size}"
            )
        if full is None:
            full = torch.empty(shape, dtype=tensor.dtype)
        full[tuple(slice(s, s + n) for s, n in zip(start, size, strict=True))] = tensor
        filled += tensor.numel()
    if filled != math.prod(shape):
        raise ValueError(f"{key}: its pieces hold {filled} values, index.json says {shape}")
    return full


def drop_tied_head(state_dict, config):
    """With tied embeddings the checkpoint may hold the table as lm_head.weight (safetensors keeps
    one name of a shared tensor), as embed_tokens, or as both (the first and last pipeline
    stages). Keep it once, as embed_tokens, the way transformers writes it."""
    if not config.tie_word_embeddings or LM_HEAD not in state_dict:
        return
    head = state_dict.pop(LM_HEAD)
    if EMBED in state_dict and not torch.equal(state_dict[EMBED], head):
        raise ValueError(
            f"the config ties the embeddings, but the checkpoint's {LM_HEAD} and {EMBED} differ"
        )
    state_dict.setdefault(EMBED, head)


def short_list(items, limit=8):
    items = list(items)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_complete(state_dict, config, where):
    """Every key the config implies, with its shape, and no other key."""
    expected = expected_shapes(config)
    if config.tie_word_embeddings:
        del expected[LM_HEAD]
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    wrong = [
        f"{key} {tuple(state_dict[key].shape)} instead of {tuple(shape)}"
        for key, shape in expected.items()
        if key in state_dict and state_dict[key].shape != shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{where} does not match its config ({config.num_hidden_layers} layers, "
            f"hidden_size {config.hidden_size}, vocab_size {config.vocab_size}): "
            f"missing [{short_list(missing)}], unexpected [{short_list(unexpected)}], "
            f"wrong shapes [{short_list(wrong)}]"
        )


def expected_shapes(config):
    """{key: shape} of every tensor a transformers checkpoint of `config` holds. A Mixtral
    (step 15's mixture of experts) has, in place of each layer's MLP, block_sparse_moe's router
    `gate` and each expert's w1, w3, w2 (an MLP's gate_proj, up_proj, down_proj)."""
    with torch.device("meta"):  # shapes only, no memory
        reference = LlamaForCausalLM(config).state_dict()
    expected = {key: tensor.shape for key, tensor in reference.items()}
    if config.model_type != "mixtral":
        return expected
    D, F, E = config.hidden_size, config.intermediate_size, config.num_local_experts
    expected = {key: shape for key, shape in expected.items() if ".mlp." not in key}
    for i in range(config.num_hidden_layers):
        moe = f"model.layers.{i}.block_sparse_moe"
        expected[f"{moe}.gate.weight"] = torch.Size([E, D])
        for e in range(E):
            for w, shape in [("w1", [F, D]), ("w3", [F, D]), ("w2", [D, F])]:
                expected[f"{moe}.experts.{e}.{w}.weight"] = torch.Size(shape)
    return expected


def read_config(folder):
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in ("llama", "mixtral"):
        raise ValueError(
            f"{folder} holds a {config.model_type!r} model, not a Llama or Mixtral one"
        )
    if getattr(config, "moe_router", "mixtral") != "mixtral":
        raise ValueError(
            f"{folder} routes its experts as Llama 4 does (step 15's --moe_router "
            f"{config.moe_router}): transformers' Mixtral has no such router nor shared expert"
        )
    return config


def load_config(name, overrides=None):
    """A LlamaConfig from assets/configs/NAME or a folder with config.json, with overrides."""
    folder = ROOT / "assets" / "configs" / name
    if not folder.is_dir():
        folder = Path(name)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no config.json in {name!r}, nor a config assets/configs/{name}")
    config = read_config(folder)
    overrides = overrides or {}
    for key, value in overrides.items():
        setattr(config, key, value)
    if "hidden_size" in overrides or "num_attention_heads" in overrides:
        config.head_dim = config.hidden_size // config.num_attention_heads
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    if D % H:
        raise ValueError(f"num_attention_heads={H} does not divide hidden_size={D}")
    if H % K:
        raise ValueError(f"num_key_value_heads={K} does not divide num_attention_heads={H}")
    return config


def load_merged_state_dict(checkpoint, config=None):
    """The full state dict of a checkpoint of any layout and its config (the checkpoint's own
    config.json unless `config` is given), checked to be complete. With tied embeddings it holds
    no lm_head.weight, like transformers' own files."""
    folder = resolve_checkpoint(checkpoint)
    if config is None:
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"{folder} has no config.json (checkpoints of steps 3-8 do not): pass the config "
                f"it was trained with (on the command line: --model_name and its overrides)"
            )
        config = read_config(folder)
    if (folder / "index.json").is_file():
        state_dict, layout = read_indexed(folder)
        pp_size, tp_size = layout["pp_size"], layout["tp_size"]
    else:
        pp_size, tp_size, shards = find_shards(folder)
        state_dict = merge_shards(pp_size, tp_size, shards)
    drop_tied_head(state_dict, config)
    check_complete(state_dict, config, f"{folder} ({describe_layout(pp_size, tp_size)})")
    return state_dict, config


def saved_layout(folder):
    """(pp_size, tp_size) of the layout that wrote a checkpoint folder."""
    if (folder / "index.json").is_file():
        layout = json.loads((folder / "index.json").read_text())["layout"]
        return layout["pp_size"], layout["tp_size"]
    return find_shards(folder)[:2]


def add_model_args(parser):
    group = parser.add_argument_group("model config, for checkpoints without config.json")
    group.add_argument("--model_name", help="a config in assets/configs (tiny, ...) or a folder")
    for name in OVERRIDES:
        group.add_argument(f"--{name}", type=int, help="override the config's value")


def config_from_args(args):
    """None when the checkpoint has its own config.json, else --model_name with overrides."""
    overrides = {key: getattr(args, key) for key in OVERRIDES if getattr(args, key) is not None}
    has_config = (resolve_checkpoint(args.checkpoint) / "config.json").is_file()
    if has_config and (args.model_name or overrides):
        raise ValueError(
            f"{args.checkpoint} has its own config.json: drop --model_name and the overrides"
        )
    if has_config:
        return None
    if args.model_name is None:
        raise ValueError(
            f"{args.checkpoint} has no config.json (checkpoints of steps 3-8 do not): pass "
            f"--model_name and the overrides it was trained with"
        )
    return load_config(args.model_name, overrides)


def resolve_tokenizer(name):
    """assets/tokenizers/NAME or a folder."""
    folder = ROOT / "assets" / "tokenizers" / name
    folder = folder if folder.is_dir() else Path(name)
    if not folder.is_dir():
        raise ValueError(f"no tokenizer folder {name!r}, nor a tokenizer assets/tokenizers/{name}")
    return folder


def export(checkpoint, out_dir, config=None, dtype=torch.float32, tokenizer=None):
    """Write `checkpoint` as a folder that LlamaForCausalLM.from_pretrained loads (or
    MixtralForCausalLM, for a mixture of experts): config.json,
    model.safetensors and, if `tokenizer` names one, the tokenizer's files."""
    folder, out_dir = resolve_checkpoint(checkpoint), Path(out_dir)
    if out_dir.resolve() == folder.resolve():
        raise ValueError(f"the output folder {out_dir} is the checkpoint itself")
    tokenizer = resolve_tokenizer(tokenizer) if tokenizer else None
    state_dict, config = load_merged_state_dict(folder, config)
    config = copy.deepcopy(config)  # the caller's config stays as it was
    moe = config.model_type == "mixtral"
    config.architectures = ["MixtralForCausalLM" if moe else "LlamaForCausalLM"]
    config.dtype = dtype
    tensors = {key: tensor.to(dtype).contiguous() for key, tensor in state_dict.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    shutil.copymode(out_dir / "config.json", out_dir / "model.safetensors")  # not safetensors' 0600
    if tokenizer:
        for file in tokenizer.iterdir():
            if file.is_file():
                shutil.copy2(file, out_dir / file.name)
    return sum(tensor.numel() for tensor in tensors.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step folder, or a run folder with a `latest` file")
    parser.add_argument("out_dir", help="the transformers folder to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tokenizer", help="copy in assets/tokenizers/NAME or a folder")
    add_model_args(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        dtype = getattr(torch, args.dtype)
        num_params = export(args.checkpoint, args.out_dir, config, dtype, args.tokenizer)
    except ValueError as error:
        print(f"export_hf.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    folder = resolve_checkpoint(args.checkpoint)
    layout = describe_layout(*saved_layout(folder))
    print(f"{folder} ({layout}) -> {args.out_dir}: {num_params:,} parameters in {args.dtype}")


if __name__ == "__main__":
    main()
