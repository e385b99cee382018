"""The command line every step shares: its flags, their checks, and the model's config.

Each numeric flag declares its domain with it, as its type (`type=COUNT`); `check_flags` checks
every flag against its domain, and against the flags it needs, before anything runs. A step's
train.py adds its technique's flags, declared the same way, to the group it gets back from
`make_parser`; everything here is the same in every step from step 3 on.

A run file (`--config run.yaml`, or JSON) holds flags as keys, `seq_len: 512`; the command line
overrides it. Every run writes its flags as resolved into run.yaml beside its checkpoints and its
log (bookkeeping), so that `--config` of that file repeats the run.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import huggingface_hub.errors
import yaml
from transformers import AutoConfig, PretrainedConfig

from utils import ArgumentParser, check_output_path, log

# Through a link (an exercise's copy of a step links them) the files themselves: their paths
# key the datasets cache of the tokenised text, which a copy then shares with the course.
ASSETS = (Path(__file__).resolve().parent.parent / "assets").resolve()


class Domain:
    """The values a number may take: a flag's, declared with it as its type (`type=COUNT`), or a
    config field's. argparse calls it to read the flag's word, so that a word that is not a number
    is refused there, naming the flag; `refusal` says what is wrong with a value. `least` or
    `above` bound it from below, `most` from above; a float must be finite, and `limit` is what
    the libraries that take the value can hold (for an int, by default, 64 bits)."""

    def __init__(self, kind, least=None, above=None, most=None, limit=None):
        self.kind, self.least, self.above, self.most = kind, least, above, most
        self.limit = 2**63 - 1 if limit is None and kind is int else limit
        self.__name__ = kind.__name__  # argparse's "invalid int value: 'abc'"

    def __call__(self, text):
        return self.kind(text)

    def refusal(self, value):
        """What is wrong with `value` ("must be at least 1"), or None where the domain holds it."""
        kinds = (int, float) if self.kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"must be of type {self.kind.__name__}"
        if not math.isfinite(value):
            return "must be finite"
        below = (self.least is not None and value < self.least) or (
            self.above is not None and value <= self.above
        )
        if below or (self.most is not None and value > self.most):
            return f"must be {self.range()}"
        if self.limit is not None and abs(value) > self.limit:
            return (
                f"must be at most {self.limit}" if value > 0 else f"must be at least {-self.limit}"
            )
        return None

    def range(self):
        """The domain in words: "at least 1", "above 0 and at most 1"."""
        words = [f"above {self.above}"] if self.above is not None else []
        if self.least is not None:
            words = ["0 or more" if self.least == 0 else f"at least {self.least}"]
        return " and ".join([*words, *([f"at most {self.most}"] if self.most is not None else [])])


COUNT = Domain(int, least=1)  # how many: steps, rows, ranks
POSITIVE = Domain(float, above=0)  # a rate, a size, a time
NON_NEGATIVE = Domain(float, least=0)  # a coefficient, which 0 turns off
# Config fields a flag may override, for a smaller or larger model of the same family.
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]
# A flag given without the one it needs: what the refusal says.
NEEDS = {
    "save_every": ("save_dir", "--save_every needs --save_dir, the folder to save to"),
    "keep_last": ("save_dir", "--keep_last needs --save_dir, the folder it keeps checkpoints in"),
    "save_dynamics": (
        "save_dir",
        "--save_dynamics needs --save_dir: it captures the checkpoints saved there",
    ),
    "resume": ("save_dir", "--resume needs --save_dir, the folder to resume from"),
    "early_stopping_patience": (
        "eval_every",
        "--early_stopping_patience counts validations: it needs --eval_every above 0",
    ),
}


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
        model.add_argument(f"--{name}", type=COUNT, help="override the config's value")
    train = parser.add_argument_group("training")
    train.add_argument("--seq_len", type=COUNT, default=256)
    train.add_argument("--micro_batch_size", type=COUNT, default=4)
    train.add_argument("--gradient_accumulation_steps", type=COUNT, default=1)
    train.add_argument("--max_steps", type=COUNT, default=250)
    train.add_argument("--learning_rate", type=POSITIVE, default=3e-3)
    train.add_argument("--warmup_steps", type=Domain(int, least=0), default=10)
    train.add_argument(
        "--lr_schedule",
        choices=["cosine", "wsd"],
        default="cosine",
        help="after the warm-up, down to 10 %% at the last step: cosine, or warmup-stable-decay "
        "(flat, then linear over the last --decay_fraction of the steps)",
    )
    train.add_argument(
        "--decay_fraction",
        type=Domain(float, above=0, most=1),
        default=0.2,
        help="wsd: the steps that decay, a fraction",
    )
    train.add_argument("--weight_decay", type=NON_NEGATIVE, default=0.1)
    train.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: Muon for the decoder layers' weight matrices, AdamW for the rest (muon.py)",
    )
    train.add_argument(
        "--muon_learning_rate",
        type=POSITIVE,
        default=0.02,
        help="--optimizer muon: the matrices' rate (--learning_rate is the rest's)",
    )
    train.add_argument("--grad_clip", type=POSITIVE, default=1.0)
    # numpy takes seeds of 32 bits
    train.add_argument("--seed", type=Domain(int, least=0, most=2**32 - 1), default=42)
    train.add_argument(
        "--on_nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="a step whose loss or gradient norm is inf or nan on any rank: stop before its "
        "update (default), or skip its update and go on",
    )
    train.add_argument(
        "--max_nonfinite_skips",
        type=COUNT,
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
    system.add_argument("--peak_tflops", type=POSITIVE, help="the device's peak, for MFU")
    system.add_argument("--log_every", type=COUNT, default=1)
    system.add_argument(
        "--dist_timeout_s",
        type=Domain(float, above=0, limit=10**9),  # timedelta and gloo overflow far above
        default=600,
        help="seconds a collective may wait for the other ranks before the job stops",
    )
    parallel = parser.add_argument_group("parallelism (the sizes multiply to the world size)")
    parallel.add_argument("--tp_size", type=COUNT, default=1, help="tensor-parallel ranks")
    parallel.add_argument("--dp_size", type=COUNT, default=1, help="data-parallel ranks")
    parallel.add_argument("--pp_size", type=COUNT, default=1, help="pipeline stages")
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
    data.add_argument("--max_tokens", type=COUNT, help="stop after this many training tokens")
    data.add_argument(
        "--num_proc",
        type=COUNT,
        default=2,
        help="processes for tokenising (the rows do not depend on it)",
    )
    data.add_argument(
        "--eval_every", type=Domain(int, least=0), default=50, help="validation every N steps"
    )
    data.add_argument("--eval_steps", type=COUNT, default=4, help="validation micro-batches")
    data.add_argument(
        "--early_stopping_patience",
        type=Domain(int, least=0),
        default=0,
        help="stop (and save) when the validation loss has not improved for this many "
        "validations in a row (0: never)",
    )
    data.add_argument("--sample_prompt", default="Once upon a time")
    data.add_argument("--sample_tokens", type=Domain(int, least=0), default=60)
    run = parser.add_argument_group("checkpoints and logging")
    run.add_argument("--save_dir", help="write checkpoints here (none if not given)")
    run.add_argument("--save_every", type=COUNT, help="every N steps (100), and always at the end")
    run.add_argument("--resume", action="store_true", help="continue from save_dir's latest")
    run.add_argument("--keep_last", type=COUNT, help="keep only the newest N checkpoints (all)")
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
    check_flags(parser, args)
    args.save_every = 100 if args.save_every is None else args.save_every
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


def check_flags(parser, args):
    """Refuse, naming the flag and its value, a value outside its flag's domain (None: a flag
    not given), then a flag given without the one it needs; the step's flags too."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action.type, Domain) and value is not None:
            why = action.type.refusal(value)
            if why:
                parser.error(f"{action.option_strings[0]} {why}, got {value}")
    for name, (needed, message) in NEEDS.items():
        if getattr(args, name) and not getattr(args, needed):
            parser.error(message)
    if args.profile and args.max_steps < 3:
        parser.error(f"--profile records steps 3 to 5; --max_steps {args.max_steps} stops before")


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
    if isinstance(action.type, Domain) and action.type.refusal(typed):
        parser.error(f"{where} {action.type.refusal(typed)}, got {value!r}")
    return [f"{flag}={text}"]  # with "=": a value that starts with "-" is not read as a flag


# Every field of transformers' LlamaConfig and MixtralConfig (and the names transformers 4 gave
# some), in one of three lists; tests/test_config_fields.py holds them to the installed
# transformers. A config's fields are checked against them when it is read (`check_config`).
# Computed here as transformers computes them (model.py, and Mixtral's experts where a step
# trains them), each with its domain: a Domain, the values it takes, or None where another
# check names the values (model.check_config: RoPE's types, the pad token's range).
IMPLEMENTED = {
    "model_type": None,  # `load_config`: the families the step trains
    "vocab_size": COUNT,
    "hidden_size": COUNT,
    "intermediate_size": COUNT,
    "num_hidden_layers": COUNT,
    "num_attention_heads": COUNT,
    "num_key_value_heads": COUNT,
    "head_dim": COUNT,  # null: hidden_size / num_attention_heads
    "max_position_embeddings": COUNT,  # a longer --seq_len is refused
    "rms_norm_eps": POSITIVE,
    "initializer_range": NON_NEGATIVE,  # the initial weights' standard deviation
    "tie_word_embeddings": (True, False),
    "pad_token_id": None,  # null, or a token of the vocabulary
    "rope_parameters": None,  # rope_type default, linear or llama3
    "rope_scaling": None,  # transformers 4's name of rope_parameters, without rope_theta
    "rope_theta": POSITIVE,  # transformers 4's
    "num_local_experts": COUNT,  # Mixtral's experts per layer
    "num_experts_per_tok": COUNT,  # up to num_local_experts: checked with the experts
    "router_aux_loss_coef": NON_NEGATIVE,  # the balancing loss's default coefficient
}
# Read by nothing that computes the model, here or in transformers, or read only by what this
# trainer does not do: why each is harmless to ignore.
HARMLESS = {
    "_name_or_path": "where transformers read the config from",
    "transformers_version": "the version that wrote the file",
    "architectures": "the class names transformers would build; model_type names the family",
    "dtype": "the dtype the weights were stored in; --dtype sets autocast, weights train in fp32",
    "torch_dtype": "transformers 4's dtype",
    "use_cache": "generation's KV cache in transformers; the sampling here always caches",
    "bos_token_id": "the tokenizer's; the data's documents end with its end-of-text token",
    "eos_token_id": "the tokenizer's, as bos_token_id",
    "output_attentions": "what transformers' forward returns, not what it computes",
    "output_hidden_states": "what transformers' forward returns, not what it computes",
    "return_dict": "what transformers' forward returns, not what it computes",
    "output_router_logits": "whether transformers' forward returns the router's logits (and adds "
    "their balancing loss); here the trainer's own flag decides the loss",
    "chunk_size_feed_forward": "read by neither Llama nor Mixtral",
    "is_encoder_decoder": "generation's setting; Llama and Mixtral are decoders whatever it says",
    "id2label": "the labels of a classification head, which a causal LM has not",
    "label2id": "the labels of a classification head, which a causal LM has not",
    "problem_type": "the loss of a classification head, which a causal LM has not",
    "pretraining_tp": "transformers 5 ignores it; in 4 it cut the same products into slices",
    "is_llama_config": "nanotron's mark (SmolLM2's config.json) of a config for transformers",
    "moe_router": "the router a mixture of experts trained with, written for the record; the "
    "run's own choice decides, and a checkpoint of another router holds other parameters",
}
# Fields that change the model unless they hold one of these values, which is what the model
# here computes: refused otherwise, naming the field and its value.
REFUSED = {
    "hidden_act": (("silu", "swish"), "the MLP here is SwiGLU"),
    "attention_bias": ((False,), "no linear layer here has a bias"),
    "mlp_bias": ((False,), "no linear layer here has a bias"),
    "attention_dropout": ((0.0,), "the model has no dropout"),
    "is_causal": ((True,), "attention is causal"),
    "partial_rotary_factor": ((1.0,), "Llama rotates the whole head"),
    "sliding_window": ((None,), "attention here sees every earlier token, not a window of them"),
    "router_jitter_noise": ((0.0,), "the router draws no random numbers here"),
    "rope_interleaved": ((False,), "RoPE here turns the two halves of a head, not neighbours"),
}
# transformers 5 checks each field's type itself (huggingface_hub's strict dataclasses).
CONFIG_ERRORS = (
    OSError,
    ValueError,
    getattr(huggingface_hub.errors, "StrictDataclassError", OSError),
)


def load_config(args, flag="--model_name", model_types=("llama",)):
    """A LlamaConfig from assets/configs/NAME, a local directory or the hub, named by `flag`,
    with the overrides. `model_types`: the transformers model types the step trains."""
    given = name = getattr(args, flag.lstrip("-"))
    if (ASSETS / "configs" / name).is_dir():
        name = str(ASSETS / "configs" / name)
    where = f"{flag} {given}"
    fields = read_config(PretrainedConfig.get_config_dict, name, where)[0]  # as the file says
    if fields.get("model_type", model_types[0]) in model_types:  # not another family's fields
        check_config(fields, where)  # before transformers' checks, which need not name the field
    config = read_config(AutoConfig.from_pretrained, name, where)
    if config.model_type not in model_types:
        raise ValueError(
            f"{where} is a {config.model_type!r} model; this step trains "
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


def read_config(read, name, where):
    """`read(name)`; a config that cannot be read is refused, saying what is missing."""
    try:
        return read(name)
    except CONFIG_ERRORS as error:  # ValueError: a folder without a config.json
        why = (
            "the folder has no valid config.json"
            if Path(name).is_dir()
            else "no such local directory, and the Hugging Face hub could not be reached or "
            "has no such model. The offline default is --model_name tiny; assets/configs holds "
            "the others"
        )
        raise ValueError(f"{where}: could not load the model config: {why}.\n{error}") from error


def check_config(fields, where):
    """Refuse, naming the field and its value, a config field that is IMPLEMENTED with a value
    outside its domain or REFUSED with a value that changes the model; name in one line the
    fields that no list holds, which transformers' Llama and Mixtral do not read either."""
    for field, value in fields.items():
        domain = IMPLEMENTED.get(field)
        if isinstance(domain, Domain) and value is not None and domain.refusal(value):
            raise ValueError(f"{where}: {field}={value!r} {domain.refusal(value)}")
        if isinstance(domain, tuple) and value not in domain:
            raise ValueError(f"{where}: {field}={value!r} must be one of {domain}")
        if field in REFUSED and value not in REFUSED[field][0]:
            only = " or ".join(f"{field}={v!r}" for v in REFUSED[field][0])
            raise ValueError(
                f"{where}: {field}={value!r} is not supported: {REFUSED[field][1]}; only {only} is"
            )
    unknown = sorted(set(fields) - set(IMPLEMENTED) - set(HARMLESS) - set(REFUSED))
    if unknown:
        log(
            f"{where}: ignoring config fields that neither this model nor transformers' reads: "
            f"{', '.join(unknown)}"
        )
