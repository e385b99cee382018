"""Step 9: a 2 x 2 x 2 run resumes exactly; a transformers checkpoint loads into any layout; a
checkpoint of any layout exports to transformers with the trainer's own validation loss."""

import math
import re
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import ROOT, TINY, check, import_step, read_log, run_step

STEP = "step9_3d_parallel"
GRID = ["--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"]
COMMON = ["--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "2"]


def first_micro_batches(split, count, micro_batch_size=2, seq_len=32, seed=42):
    """The micro-batches the trainer reads first, made by step 3's own loader."""
    data = import_step("step3_dataloader", "dataloader")
    tokenizer = data.load_tokenizer("tinytales")
    train, validation = data.load_splits("tinytales", seed)
    rows = data.tokenize(train if split == "train" else validation, tokenizer, seq_len, 1)
    loader = data.MicroBatchDataLoader(rows, micro_batch_size, seed, "cpu", split == "train")
    return [next(loader) for _ in range(count)]


@torch.no_grad()
def mean_loss(model, batches):
    losses = [F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    return torch.stack(losses).mean().item()


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """20 steps at tp 2 x dp 2 x pp 2 (8 processes), checkpoints at 10 and 20."""
    tmp = tmp_path_factory.mktemp("grid")
    log_file, save = tmp / "log.jsonl", tmp / "ckpt"
    args = [*TINY, *GRID, *COMMON, "--max_steps", "20", "--eval_every", "10", "--log_file"]
    args += [str(log_file), "--save_dir", str(save), "--save_every", "10"]
    result = check(run_step(STEP, args, nproc=8))
    return args, read_log(log_file), save, result


def test_grid_resumes_with_identical_losses(tmp_path, grid_run):
    args, records, save, _ = grid_run
    (save / "latest").write_text("step_000010")  # as if the run had died after step 10
    resumed_log = tmp_path / "resumed.jsonl"
    args = [*args[: args.index("--log_file")], "--log_file", str(resumed_log)]
    args += ["--save_dir", str(save), "--resume"]
    check(run_step(STEP, args, nproc=8))
    resumed = read_log(resumed_log)
    assert [r["step"] for r in resumed] == list(range(11, 21))
    for got, want in zip(resumed, records[10:], strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
    assert resumed[-1]["val_loss"] == records[-1]["val_loss"]


def test_grid_checkpoint_exports_to_transformers(tmp_path, grid_run):
    """The exported model's validation loss is the one the 8 ranks logged at that step."""
    _, records, save, _ = grid_run
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from export_hf import export
    finally:
        sys.path.remove(str(ROOT / "tools"))
    export(save / "step_000020", tmp_path / "hf")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    loss = mean_loss(model, first_micro_batches("validation", 2))
    assert loss == pytest.approx(records[-1]["val_loss"], rel=1e-5)


# The shape of Llama 3.2 in small: tied embeddings, grouped-query attention, and the Llama 3
# RoPE scaling with an original context of 64 tokens, so that it changes most frequencies.
LLAMA_3_2 = dict(
    tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=128,
    rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    },
)  # fmt: skip


def tiny_hf_config(**fields):
    shape = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    return transformers.LlamaConfig(
        **shape,
        num_attention_heads=4,
        num_key_value_heads=2,
        **{"max_position_embeddings": 64, **fields},
    )


@pytest.mark.parametrize(
    "layout, fields",
    [
        (["--pp_size", "2", "--tp_size", "2"], {"tie_word_embeddings": True}),
        (["--dp_size", "2", "--tp_size", "2"], {}),
        (["--pp_size", "2", "--tp_size", "2"], LLAMA_3_2),
    ],
    ids=["pp2-tp2-tied", "dp2-tp2", "pp2-tp2-llama3.2"],
)
def test_init_from_hf_into_a_layout(tmp_path, layout, fields):
    """A transformers checkpoint loaded slice by slice: the first step's loss (computed before
    the update) is the transformers model's loss on the same batch. Tied, the file has no
    lm_head: the last stage's copy takes the embedding's slices. With --resume, the first start
    loads the folder; started again (dp 2 x tp 2), the run resumes from its checkpoint instead."""
    config = tiny_hf_config(**fields)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    # Weights far from the initial ones: with those, attention is nearly uniform and the loss
    # hardly depends on the rotation (a wrong RoPE scaling moves it by 1e-6, not 1e-3).
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(
                torch.rand_like(param) + 0.5 if param.ndim == 1 else 0.1 * torch.randn_like(param)
            )
    reference.save_pretrained(tmp_path / "hf")
    log_file = tmp_path / "log.jsonl"
    args = ["--init_from_hf", str(tmp_path / "hf"), "--seq_len", "32", "--micro_batch_size", "2"]
    args += ["--max_steps", "1", "--gradient_accumulation_steps", "2", *layout, *COMMON]
    args += ["--log_file", str(log_file), "--save_dir", str(tmp_path / "run"), "--resume"]
    result = check(run_step(STEP, args, nproc=math.prod(map(int, layout[1::2]))))
    assert "--resume: no checkpoint in" in result.stdout and "weights from" in result.stdout
    dp = 2 if "--dp_size" in layout else 1
    expected = mean_loss(reference, first_micro_batches("train", 2 * dp))
    assert read_log(log_file)[0]["loss"] == pytest.approx(expected, rel=1e-5)
    if dp == 2:  # the same job started again: it resumes from its checkpoint, not the folder
        args[args.index("--max_steps") + 1] = "2"
        result = check(run_step(STEP, args, nproc=4))
        assert "not loaded, the run resumes from its checkpoint" in result.stdout
        assert "weights from" not in result.stdout
        assert [r["step"] for r in read_log(log_file)] == [1, 2]


def test_init_from_hf_refuses_what_the_model_would_not_compute(tmp_path):
    """A config that the model does not compute as transformers does is refused before any
    weight is read; so is a tensor that no parameter takes (biases, under a config without)."""
    transformers.LlamaForCausalLM(tiny_hf_config(attention_bias=True)).save_pretrained(tmp_path)
    args = ["--init_from_hf", str(tmp_path), "--seq_len", "32", "--micro_batch_size", "2"]
    result = run_step(STEP, [*args, *COMMON, "--max_steps", "1"], torchrun=False)
    assert result.returncode == 2 and "attention_bias=True" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    train = import_step(STEP, "train")
    for field, value in [("hidden_act", "gelu"), ("mlp_bias", True)]:
        tiny_hf_config(**{field: value}).save_pretrained(tmp_path / field)
        # Weights beside the config, so that the folder passes the flag checks of parse_args.
        shutil.copy(tmp_path / "model.safetensors", tmp_path / field)
        args = train.parse_args(["--init_from_hf", str(tmp_path / field), "--seq_len", "32"])
        with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
            config = train.load_config(args, train.config_flag(args))
            train.LlamaForCausalLM(config)  # the first thing build_model does
    config = tiny_hf_config()  # the same checkpoint, its config.json now without biases
    config.save_pretrained(tmp_path)
    stray = r"parameter for the checkpoint's model\.layers\.0\.self_attn\.k_proj\.bias, "
    with pytest.raises(ValueError, match=stray + ".* and 7 more"):
        sys.modules["hf_import"].load_hf_weights(train.LlamaForCausalLM(config), tmp_path)


def test_init_from_hf_refuses_overrides(tmp_path):
    result = run_step(STEP, ["--init_from_hf", str(tmp_path), "--hidden_size", "64"])
    assert result.returncode != 0 and "no overrides" in result.stderr
