"""The command line every step shares: its flags, their checks, and the model's config.

A step's train.py adds its technique's flags to the group it gets back from `make_parser` and
checks them itself; everything here is the same in every step from step 3 on.

A run file (`--config run.yaml`, or JSON) holds flags as keys, `seq_len: 512`; the command line
overrides it. Every run writes its flags as resolved into run.yaml beside its checkpoints and its
log (bookkeeping), so that `--config` of that file repeats the run.
"""

import argparse
import json
import sys
from pathlib import Path

import yaml
from transformers import AutoConfig

from utils import ArgumentParser, check_output_path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Config fields a flag may override, for a smaller or larger model of the same family.
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]
# Checked by `parse`: counts must be at least 1, rates above 0, the rest 0 or more.
AT_LEAST_ONE = [
    "seq_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "log_every",
    "eval_steps",
    "save_every",
    "num_proc",
    "max_nonfinite_skips",
]
ABOVE_ZERO = ["learning_rate", "muon_learning_rate", "grad_clip", "dist_timeout_s"]
ZERO_OR_MORE = ["weight_decay", "warmup_steps", "eval_every", "sample_tokens"]
ZERO_OR_MORE += ["early_stopping_patience"]


def make_parser(description):
    """The shared flags; returns the parser and its parallelism group, for the step's own."""
    parser = ArgumentParser(description=description)
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name",
        default="tiny",
        help="a config in assets/configs (tiny, smollm-135m, ...), a local directory or a hub id",
    )
    for name in OVERRIDES:
        model.add_argument(f"--{name}", type=int, help="override the config's value")
    train = parser.add_argument_group("training")
    train.add_argument("--seq_len", type=int, default=256)
    train.add_argument("--micro_batch_size", type=int, default=4)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--max_steps", type=int, default=250)
    train.add_argument("--learning_rate", type=float, default=3e-3)
    train.add_argument("--warmup_steps", type=int, default=10)
    train.add_argument(
        "--lr_schedule",
        choices=["cosine", "wsd"],
        default="cosine",
        help="after the warm-up, down to 10 %% at the last step: cosine, or warmup-stable-decay "
        "(flat, then linear over the last --decay_fraction of the steps)",
    )
    train.add_argument(
        "--decay_fraction", type=float, default=0.2, help="wsd: the steps that decay, a fraction"
    )
    train.add_argument("--weight_decay", type=float, default=0.1)
    train.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: Muon for the decoder layers' weight matrices, AdamW for the rest (muon.py)",
    )
    train.add_argument(
        "--muon_learning_rate",
        type=float,
        default=0.02,
        help="--optimizer muon: the matrices' rate (--learning_rate is the rest's)",
    )
    train.add_argument("--grad_clip", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=42)
    train.add_argument(
        "--on_nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="a step whose loss or gradient norm is inf or nan on any rank: stop before its "
        "update (default), or skip its update and go on",
    )
    train.add_argument(
        "--max_nonfinite_skips",
        type=int,
        default=3,
        help="with skip: stop after this many in a row",
    )
    system = parser.add_argument_group("system")
    system.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    system.add_argument(
        "--dtype",
        default="auto",
        help="autocast dtype: auto, float32, bfloat16, float16 (with dynamic loss scaling)",
    )
    system.add_argument("--compile", action="store_true", help="torch.compile the model")
    system.add_argument("--peak_tflops", type=float, help="the device's peak, for MFU")
    system.add_argument("--log_every", type=int, default=1)
    system.add_argument(
        "--dist_timeout_s",
        type=float,
        default=600,
        help="seconds a collective may wait for the other ranks before the job stops",
    )
    parallel = parser.add_argument_group("parallelism (the sizes multiply to the world size)")
    parallel.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks")
    parallel.add_argument("--dp_size", type=int, default=1, help="data-parallel ranks")
    parallel.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    parallel.add_argument(
        "--comm_stats", action="store_true", help="log what the first step sends, by group and kind"
    )
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", default="tinytales", help="assets/datasets/NAME or hub id")
    data.add_argument("--tokenizer_name", default="tinytales", help="assets/tokenizers/NAME or hub")
    data.add_argument(
        "--streaming",
        action="store_true",
        help="read --dataset_name as a stream, tokenised as it is served, in its own order",
    )
    data.add_argument("--max_tokens", type=int, help="stop after this many training tokens")
    data.add_argument(
        "--num_proc",
        type=int,
        default=2,
        help="processes for tokenising (the rows do not depend on it)",
    )
    data.add_argument("--eval_every", type=int, default=50, help="validation every N steps")
    data.add_argument("--eval_steps", type=int, default=4, help="validation micro-batches")
    data.add_argument(
        "--early_stopping_patience",
        type=int,
        default=0,
        help="stop (and save) when the validation loss has not improved for this many "
        "validations in a row (0: never)",
    )
    data.add_argument("--sample_prompt", default="Once upon a time")
    data.add_argument("--sample_tokens", type=int, default=60)
    run = parser.add_argument_group("checkpoints and logging")
    run.add_argument("--save_dir", help="write checkpoints here (none if not given)")
    run.add_argument("--save_every", type=int, help="every N steps (100), and always at the end")
    run.add_argument("--resume", action="store_true", help="continue from save_dir's latest")
    run.add_argument("--keep_last", type=int, help="keep only the newest N checkpoints (all)")
    run.add_argument(
        "--low_disk",
        choices=["stop", "skip_save"],
        default="stop",
        help="when a checkpoint would not fit on the disk: stop (default), or skip it and train on",
    )
    run.add_argument(
        "--save_dynamics",
        action="store_true",
        help="with each checkpoint, a probe batch's activations and gradients "
        "(tools/dynamics.py capture, into save_dir/dynamics)",
    )
    run.add_argument("--log_file", help="one JSON line per optimizer step")
    run.add_argument("--use_wandb", action="store_true", help="log to Weights & Biases")
    run.add_argument("--run_name", default="pico3d")
    run.add_argument("--profile", metavar="DIR", help="trace steps 3-5 with torch.profiler")
    run.add_argument(
        "--config",
        metavar="RUN_FILE",
        help="a YAML or JSON file of flags (key: value); flags on the command line override it",
    )
    return parser, parallel


def add_trace_flag(group, flag, what):
    """A flag that turns an instrument on (`what` it does) and may name a Chrome trace to write:
    `--flag FILE`, or the flag alone, which writes to save_dir/<name>.json with --save_dir."""
    trace = f"save_dir/{flag.lstrip('-')}.json"
    help = f"{what}; also write the step as a Chrome trace to TRACE_JSON (alone: to {trace})"
    group.add_argument(flag, nargs="?", const="", metavar="TRACE_JSON", help=help)


def parse(parser, argv, tokens_per_step):
    """Parse and check the shared flags. `tokens_per_step(args)`: the tokens of one optimizer
    step, which --max_tokens is counted in."""
    args = parser.parse_args(with_run_file(parser, argv))
    # What the run file written beside the checkpoints holds: the flags as given, before the
    # checks below fill in defaults and paths. Not --resume, which says how this run started.
    args.resolved_flags = {
        a.dest: getattr(args, a.dest)
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "config", "resume")
    }
    if args.save_every is not None and not args.save_dir:
        parser.error("--save_every needs --save_dir, the folder to save to")
    args.save_every = 100 if args.save_every is None else args.save_every
    given = [name for name in [*OVERRIDES, "keep_last"] if getattr(args, name) is not None]
    for name in AT_LEAST_ONE + given:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ABOVE_ZERO:
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be above 0, got {getattr(args, name)}")
        if getattr(args, name) == float("inf"):
            parser.error(f"--{name} must be finite, got {getattr(args, name)}")
    for name in ZERO_OR_MORE:
        if not getattr(args, name) >= 0:
            parser.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if not 0 < args.decay_fraction <= 1:
        parser.error(f"--decay_fraction must be above 0 and at most 1, got {args.decay_fraction}")
    if args.early_stopping_patience and not args.eval_every:
        parser.error("--early_stopping_patience counts validations: it needs --eval_every above 0")
    if args.profile and args.max_steps < 3:
        parser.error(f"--profile records steps 3 to 5; --max_steps {args.max_steps} stops before")
    if args.keep_last is not None and not args.save_dir:
        parser.error("--keep_last needs --save_dir, the folder it keeps checkpoints in")
    if args.save_dynamics and not args.save_dir:
        parser.error("--save_dynamics needs --save_dir: it captures the checkpoints saved there")
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save_dir, the folder to resume from")
    for flag in [a.option_strings[0] for a in parser._actions if a.metavar == "TRACE_JSON"]:
        name = flag.lstrip("-")
        if getattr(args, name) == "" and args.save_dir:
            setattr(args, name, str(Path(args.save_dir) / f"{name}.json"))
        if getattr(args, name):
            check_output_path(flag, getattr(args, name), folder=False)
    if args.save_dir:
        check_output_path("--save_dir", args.save_dir, folder=True)
    if args.log_file:
        check_output_path("--log_file", args.log_file, folder=False)
    args.tokens_per_step = tokens_per_step(args)
    args.max_steps_given = args.max_steps  # a resume counts the tokens trained before it again
    if args.max_tokens is not None:
        if args.max_tokens < args.tokens_per_step:
            parser.error(
                f"--max_tokens {args.max_tokens} is less than one step's {args.tokens_per_step}"
            )
        args.max_steps = min(args.max_steps, args.max_tokens // args.tokens_per_step)
    return args


def with_run_file(parser, argv):
    """The command line with --config's flags put first, so that those given on the command
    line, parsed later, override them. A key that is not a flag, or a value that its flag would
    refuse, is refused with the key's name before anything runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    find = argparse.ArgumentParser(add_help=False)
    find.add_argument("--config")
    path = find.parse_known_args(argv)[0].config
    if path is None:
        return argv
    where, kind = f"--config {path}", "JSON" if path.endswith(".json") else "YAML"
    try:
        text = Path(path).read_text()
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except OSError as error:
        parser.error(f"{where} cannot be read: {error.strerror}")
    except (ValueError, yaml.YAMLError) as error:
        parser.error(f"{where} is not valid {kind}: {error}")
    if not isinstance(values, dict):
        parser.error(f"{where} must map flag names to values; it holds {values!r:.60}")
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    flags = []
    for key, value in values.items():
        if key not in actions or key in ("help", "config"):
            parser.error(f"{where}: {key!r} is not a flag of this step (--help lists them)")
        flags += as_flags(parser, f"{where}: {key}", actions[key], value)
    return flags + argv


def as_flags(parser, where, action, value):
    """One key of a run file as command-line words; None leaves the flag's default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            parser.error(f"{where} must be true or false, got {value!r}")
        return [flag] if value else []
    if value is None:
        return []
    if isinstance(value, (bool, dict, list)):
        parser.error(f"{where} must be one value of the flag's type, got {value!r}")
    if action.nargs == "?" and value == action.const:  # a trace flag given alone
        return [flag]
    text = str(value)  # str of a float is its shortest exact form: the same float back
    try:
        typed = action.type(text) if action.type else text
    except ValueError:
        parser.error(f"{where} must be of type {action.type.__name__}, got {value!r}")
    if action.choices and typed not in action.choices:
        parser.error(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return [f"{flag}={text}"]  # with "=": a value that starts with "-" is not read as a flag


def load_config(args, flag="--model_name", model_types=("llama",)):
    """A LlamaConfig from assets/configs/NAME, a local directory or the hub, named by `flag`,
    with the overrides. `model_types`: the transformers model types the step trains."""
    given = name = getattr(args, flag.lstrip("-"))
    if (ASSETS / "configs" / name).is_dir():
        name = str(ASSETS / "configs" / name)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:  # ValueError: a folder without a config.json
        where = (
            "the folder has no valid config.json"
            if Path(name).is_dir()
            else "no such local directory, and the Hugging Face hub could not be reached or "
            "has no such model. The offline default is --model_name tiny; assets/configs holds "
            "the others"
        )
        raise ValueError(
            f"{flag} {given}: could not load the model config: {where}.\n{error}"
        ) from error
    if config.model_type not in model_types:
        raise ValueError(
            f"{flag} {given} is a {config.model_type!r} model; this step trains "
            f"{' and '.join(model_types)} models"
        )
    for key in OVERRIDES:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
            if key in ("hidden_size", "num_attention_heads"):
                config.head_dim = config.hidden_size // config.num_attention_heads
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    if D % H:
        raise ValueError(f"num_attention_heads={H} does not divide hidden_size={D}")
    if H % K:
        raise ValueError(f"num_key_value_heads={K} does not divide num_attention_heads={H}")
    d = getattr(config, "head_dim", None) or D // H
    if d % 2:
        raise ValueError(
            f"head_dim={d} (hidden_size / num_attention_heads = {D} / {H}) is odd: the rotary "
            f"embedding turns pairs of dimensions, so it must be even"
        )
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={args.seq_len} exceeds "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    return config
