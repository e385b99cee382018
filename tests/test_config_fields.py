"""Every field of a transformers Llama or Mixtral config is accounted for in flags.py: computed
here (IMPLEMENTED, with its domain), harmless to ignore (HARMLESS, with why), or refused when it
holds a value that changes the model (REFUSED). Every config under assets/ loads; edited ones
that ask for what the model does not compute are refused, naming the field and the value, before
anything is built, and those that it computes are built.

Each config goes through step 15's `load_config` (the only one that reads Mixtral's too; flags.py
is the same file in steps 3-15), then the model is built on the meta device, as build_model
starts: model.check_config refuses there what the lists leave to it (RoPE's types, the pad
token's range)."""

import json

import pytest
import torch
import transformers
from conftest import ROOT, import_step, run_in_process

S15 = "step15_expert_parallel"
ASSETS = sorted(path.name for path in (ROOT / "assets/configs").iterdir())
NOTE = "ignoring config fields that neither this model nor transformers' reads"


@pytest.fixture(scope="module")
def step15():
    """Step 15's train module, imported once for the module (each import takes a while)."""
    return import_step(S15, "train")


def load(train, name, tmp_path=None, base=None, change=None):
    """The config load_config reads (assets/configs/`name`, or `base` with the fields of `change`
    written over it, in tmp_path), and the model it builds (meta)."""
    if base is not None:
        fields = json.loads((ROOT / "assets/configs" / base / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**fields, **change}))
        name = str(tmp_path)
    args = train.parse_args(["--model_name", name, "--seq_len", "32"])
    config = train.load_config(args, "--model_name", train.MODEL_TYPES)
    with torch.device("meta"):
        return config, train.LlamaForCausalLM(config)


@pytest.mark.parametrize("family", [transformers.LlamaConfig, transformers.MixtralConfig])
def test_every_field_is_in_one_list(family):
    flags = import_step(S15, "flags")
    lists = {"IMPLEMENTED": flags.IMPLEMENTED, "HARMLESS": flags.HARMLESS}
    lists["REFUSED"] = flags.REFUSED
    names = list(lists)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            both = set(lists[first]) & set(lists[second])
            assert not both, f"in {first} and in {second}: {both}"
    fields = family().to_dict()
    listed = set().union(*lists.values())
    assert not set(fields) - listed, f"{family.__name__} fields in no list"
    assert all(why for why in flags.HARMLESS.values())
    assert all(allowed and why for allowed, why in flags.REFUSED.values())
    flags.check_config(fields, family.__name__)  # transformers' defaults are this model


@pytest.mark.parametrize("name", ASSETS)
def test_every_config_in_assets_loads(name, step15, capsys):
    config, model = load(step15, name)
    assert model.config is config
    assert NOTE not in capsys.readouterr().out


# (base config, fields written over it, what the refusal says; None: built).
EDITS = [
    ("tiny", {"attention_bias": True}, "attention_bias=True is not supported: no linear layer"),
    ("tiny", {"mlp_bias": True}, "mlp_bias=True is not supported: no linear layer here has a bias"),
    ("tiny", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh' is not supp"),
    ("tiny", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ("tiny", {"sliding_window": 64}, "sliding_window=64 is not supported: attention here sees"),
    ("tiny", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ("tiny", {"rope_interleaved": True}, "rope_interleaved=True is not supported"),
    ("tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not"),
    ("tiny", {"pad_token_id": 5000}, "pad_token_id=5000 is not a token of vocab_size=2048"),
    ("tiny", {"num_attention_heads": 0}, "num_attention_heads=0 must be at least 1"),
    ("tiny", {"hidden_size": "256"}, "hidden_size='256' must be of type int"),
    ("tiny", {"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be above 0"),
    ("tiny", {"initializer_range": float("nan")}, "initializer_range=nan must be finite"),
    ("tiny", {"tie_word_embeddings": True}, None),
    ("tiny", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),
    ("tiny", {"is_llama_config": True, "rope_interleaved": False, "pretraining_tp": 2}, None),
    ("tiny-moe", {"sliding_window": 4096}, "sliding_window=4096 is not supported"),
    ("tiny-moe", {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be at least 1"),
    ("tiny-moe", {"num_local_experts": 0}, "num_local_experts=0 must be at least 1"),
    ("tiny-moe", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 is not supported"),
    ("tiny-moe", {"output_router_logits": True, "use_cache": False}, None),
]


@pytest.mark.parametrize(
    ("base", "change", "message"), EDITS, ids=[f"{b}-{'-'.join(c)}" for b, c, _ in EDITS]
)
def test_an_edited_config_is_built_or_refused(base, change, message, step15, tmp_path, capsys):
    if message is None:
        config, model = load(step15, None, tmp_path, base, change)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == (
            config.tie_word_embeddings
        )
        assert NOTE not in capsys.readouterr().out
        return
    with pytest.raises(ValueError) as refused:
        load(step15, None, tmp_path, base, change)
    assert message in str(refused.value)


def test_a_field_no_list_holds_is_named(step15, tmp_path, capsys):
    """transformers' model does not read it either, so the model is the same; the run says so."""
    load(step15, None, tmp_path, "tiny", {"attention_window": 64})
    assert f"--model_name {tmp_path}: {NOTE}: attention_window" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("step", "base", "change", "message"),
    [
        ("step3_dataloader", "tiny", {"num_attention_heads": 0}, "num_attention_heads=0 must"),
        (S15, "tiny-moe", {"sliding_window": 4096}, "sliding_window=4096 is not supported"),
    ],
    ids=["step3-num_attention_heads", "step15-sliding_window"],
)
def test_the_trainer_refuses_in_one_line(
    step, base, change, message, tmp_path, capsys, monkeypatch
):
    """As `python train.py` would: exit status 2, one line, no traceback (num_attention_heads=0
    used to raise ZeroDivisionError in transformers' own check)."""
    fields = json.loads((ROOT / "assets/configs" / base / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, **change}))
    args = ["--model_name", str(tmp_path), "--seq_len", "32", "--max_steps", "1"]
    code, output, _ = run_in_process(step, args, capsys, monkeypatch)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output
