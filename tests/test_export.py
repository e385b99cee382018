"""tools/export_hf.py and tools/sample.py against the model that the checkpoints were cut from.

A random transformers Llama is cut into fake checkpoints of each layout, slicing its weights the
way the tensor- and pipeline-parallel steps save them; the merged weights must equal the
original's, and the exported folder must load into transformers with the original's logits.
"""

import os
import subprocess
import sys
from bisect import bisect_right
from collections import defaultdict
from itertools import accumulate

import pytest
import torch
import transformers
from conftest import LAUNCH, ROOT, assert_weights_readable_as_config, check
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(ROOT / "tools"))
import export_hf  # noqa: E402
import sample as sample_tool  # noqa: E402

# The tools read local folders only; a hub lookup would fail at once instead of retrying.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
# The tools as `python tool.py` runs them, forked from the tests' launch server, which has
# imported torch and transformers once for all of them.
TOOL = [*LAUNCH, "--python"]


def env():
    """ENV, with the server the session started (after this module was imported)."""
    return {**ENV, **os.environ}


TOKENIZER = ROOT / "assets" / "tokenizers" / "tinytales"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# name: (layers of each pipeline stage or None, tp_size, where a tied table is NOT saved)
LAYOUTS = {
    "one_device": (None, 1, EMBED),  # safetensors' save_model keeps the name lm_head.weight
    "tp2": (None, 2, LM_HEAD),
    "pp2_tp2": ([3, 2], 2, None),  # the first stage holds embed_tokens, the last lm_head
    "pp3_tp1": ([2, 2, 1], 1, None),
}
# Tensor parallelism splits these by rows (output features, or the vocabulary) ...
ROWS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"}
# ... and these by columns (input features); every rank holds the RMSNorm weights whole.
COLUMNS = {"o_proj", "down_proj"}


def tiny_config(tied, vocab_size=64):
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )


def random_model(config, seed=0):
    """Weights far from the initial ones (norms not all ones), so a misplaced slice shows."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    return model


def stage_of(key, layers_per_stage):
    """The pipeline stage holding `key`: the first has the embedding, the last the final norm
    and lm_head, and stage p the p-th contiguous range of layers."""
    if key == EMBED:
        return 0
    if not key.startswith("model.layers."):
        return len(layers_per_stage) - 1
    return bisect_right(list(accumulate(layers_per_stage)), int(key.split(".")[2]))


def tp_pieces(key, tensor, tp_size):
    module = key.split(".")[-2]
    if module in ROWS:
        return tensor.chunk(tp_size, 0)
    if module in COLUMNS:
        return tensor.chunk(tp_size, 1)
    return [tensor] * tp_size


def shard_name(p, pp_size, t, tp_size, pipeline):
    if pipeline:
        return f"model-pp{p}-of-{pp_size}-tp{t}-of-{tp_size}.safetensors"
    return "model.safetensors" if tp_size == 1 else f"model-tp{t}-of-{tp_size}.safetensors"


def write_checkpoint(model, run_dir, layout, with_config=True):
    """Write run_dir/step_000010 in `layout`, as the trainer would; returns the step folder."""
    layers_per_stage, tp_size, tied_absent = LAYOUTS[layout]
    pipeline = layers_per_stage is not None
    layers_per_stage = layers_per_stage or [model.config.num_hidden_layers]
    assert sum(layers_per_stage) == model.config.num_hidden_layers
    shards = defaultdict(dict)
    for key, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and key == tied_absent:
            continue
        p = stage_of(key, layers_per_stage)
        for t, piece in enumerate(tp_pieces(key, tensor, tp_size)):
            name = shard_name(p, len(layers_per_stage), t, tp_size, pipeline)
            shards[name][key] = piece.contiguous().clone()
    folder = run_dir / "step_000010"
    folder.mkdir(parents=True)
    for name, tensors in shards.items():
        save_file(tensors, folder / name)
    (folder / "trainer_state-tp0-of-1.pt").write_bytes(b"ignored")
    (run_dir / "latest").write_text("step_000010\n")
    if with_config:
        model.config.save_pretrained(folder)
    return folder


def assert_same_model(folder, model):
    """The exported folder loads into transformers, every weight from the file, same logits."""
    exported, info = transformers.LlamaForCausalLM.from_pretrained(
        folder, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if model.config.tie_word_embeddings:
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
    input_ids = torch.randint(0, model.config.vocab_size, (3, 11))
    expected = model(input_ids).logits
    torch.testing.assert_close(exported.eval()(input_ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_gives_the_original_model(tmp_path, layout, tied):
    model = random_model(tiny_config(tied))
    step = write_checkpoint(model, tmp_path / "run", layout)
    state_dict, _ = export_hf.load_merged_state_dict(step)
    original = model.state_dict()
    if tied:
        del original[LM_HEAD]
    assert state_dict.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(state_dict[key], tensor), key
    export_hf.export(step, tmp_path / "hf")
    assert_same_model(tmp_path / "hf", model)


def test_export_cli_without_config_json(tmp_path):
    """Like a checkpoint of steps 3-8: no config.json, so --model_name and an override give the
    shapes. The run folder is followed to its latest step; the tokenizer is copied in."""
    config = tiny_config(tied=True)
    model = random_model(config)
    write_checkpoint(model, tmp_path / "run", "pp2_tp2", with_config=False)
    transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2}).save_pretrained(
        tmp_path / "base"
    )
    command = [*TOOL, str(ROOT / "tools" / "export_hf.py"), tmp_path / "run"]
    command += [tmp_path / "hf", "--model_name", tmp_path / "base", "--num_hidden_layers", "5"]
    command += ["--tokenizer", TOKENIZER]
    check(subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=120))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert_weights_readable_as_config(tmp_path / "hf")
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert exported.architectures == ["LlamaForCausalLM"] and exported.num_hidden_layers == 5
    assert_same_model(tmp_path / "hf", model)


def test_export_bfloat16(tmp_path):
    model = random_model(tiny_config(tied=False))
    step = write_checkpoint(model, tmp_path / "run", "tp2")
    export_hf.export(step, tmp_path / "hf", dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    for key, tensor in model.state_dict().items():
        assert tensors[key].dtype == torch.bfloat16, key
        assert torch.equal(tensors[key], tensor.to(torch.bfloat16)), key


@pytest.mark.parametrize(
    "names, message",
    [
        (["model-tp0-of-3.safetensors", "model-tp2-of-3.safetensors"], "missing model-tp1-of-3"),
        (["model-pp0-of-2-tp0-of-1.safetensors"], "missing model-pp1-of-2-tp0-of-1"),
        (["model.safetensors", "model-tp0-of-2.safetensors"], "mixes"),
        (["model-tp0-of-2.safetensors", "model-tp1-of-3.safetensors"], "mixes"),
        (["model-tp0-of-1.safetensors", "model-tp1-of-1.safetensors"], "out of range"),
        (["model-00001-of-00002.safetensors"], "no known layout"),
    ],
)
def test_inconsistent_layout_is_refused(tmp_path, names, message):
    for name in names:
        save_file({"x": torch.zeros(1)}, tmp_path / name)
    with pytest.raises(ValueError, match=message) as error:
        export_hf.load_merged_state_dict(tmp_path, tiny_config(tied=False))
    assert all(name in str(error.value) for name in names), "the message lists the files found"


def test_missing_shard_is_refused(tmp_path):
    step = write_checkpoint(random_model(tiny_config(False)), tmp_path / "run", "pp2_tp2")
    (step / "model-pp1-of-2-tp0-of-2.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete pp 2 x tp 2 checkpoint") as error:
        export_hf.load_merged_state_dict(tmp_path / "run")
    assert "missing model-pp1-of-2-tp0-of-2.safetensors" in str(error.value)


def edit_shard(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_replicated_weights_that_differ_are_refused(tmp_path):
    step = write_checkpoint(random_model(tiny_config(False)), tmp_path / "run", "tp2")
    key = "model.layers.2.post_attention_layernorm.weight"
    edit_shard(step / "model-tp1-of-2.safetensors", lambda tensors: tensors[key][5].add_(1e-3))
    with pytest.raises(ValueError, match=rf"{key} is replicated on every tp rank, but"):
        export_hf.load_merged_state_dict(step)


def test_tp_ranks_with_different_keys_are_refused(tmp_path):
    step = write_checkpoint(random_model(tiny_config(False)), tmp_path / "run", "tp2")
    key = "model.layers.3.self_attn.k_proj.weight"
    edit_shard(step / "model-tp1-of-2.safetensors", lambda tensors: tensors.pop(key))
    with pytest.raises(
        ValueError, match=f"do not hold the same keys; only one of them holds {key}"
    ):
        export_hf.load_merged_state_dict(step)


def test_missing_duplicate_and_mismatched_keys_are_named(tmp_path):
    config = tiny_config(False)
    step = write_checkpoint(random_model(config), tmp_path / "run", "pp3_tp1")
    last, middle = (
        step / "model-pp2-of-3-tp0-of-1.safetensors",
        step / "model-pp1-of-3-tp0-of-1.safetensors",
    )
    down = "model.layers.4.mlp.down_proj.weight"
    edit_shard(last, lambda tensors: tensors.pop(down))
    with pytest.raises(ValueError, match=rf"missing \[{down}\], unexpected \[\]"):
        export_hf.load_merged_state_dict(step)
    four_layers = tiny_config(False)
    four_layers.num_hidden_layers = 4  # the checkpoint has a fifth, in part
    with pytest.raises(ValueError, match=r"unexpected \[model\.layers\.4\.input_layernorm"):
        export_hf.load_merged_state_dict(step, four_layers)
    norm = "model.layers.1.input_layernorm.weight"
    edit_shard(middle, lambda tensors: tensors.update({norm: torch.ones(32)}))
    with pytest.raises(ValueError, match=f"{norm} is in both model-pp0-of-3"):
        export_hf.load_merged_state_dict(step)
    (step / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json .* --model_name"):
        export_hf.load_merged_state_dict(step)


@torch.no_grad()
def greedy(model, tokenizer, prompt, num_tokens):
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])  # (1, T)
    for _ in range(num_tokens):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokenizer.decode(ids[0])


def test_sample_cli_greedy_is_the_models_argmax(tmp_path):
    """--temperature 0 picks the likeliest token, so the text is the original model's argmax
    continuation, the same in every run."""
    model = random_model(tiny_config(tied=False, vocab_size=2048))
    write_checkpoint(model, tmp_path / "run", "tp2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    expected = greedy(model, tokenizer, "Once upon a time", 8)
    assert expected.startswith("Once upon a time") and expected != "Once upon a time"
    command = [*TOOL, str(ROOT / "tools" / "sample.py"), tmp_path / "run"]
    command += ["--num_tokens", "8", "--temperature", "0", "--device", "cpu"]
    result = check(
        subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=120)
    )
    assert result.stdout == expected + "\n"


def test_sampling_is_seeded_and_top_k(tmp_path):
    """The rebuilt model (tied embeddings) draws what the original draws from the same seed; a
    top-1 draw, or a near-zero temperature over the whole vocabulary, is the greedy choice."""
    model = random_model(tiny_config(tied=True, vocab_size=2048))
    step = write_checkpoint(model, tmp_path / "run", "one_device")
    rebuilt = sample_tool.build_model(*export_hf.load_merged_state_dict(step), torch.device("cpu"))
    assert rebuilt.lm_head.weight is rebuilt.model.embed_tokens.weight
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    texts = [
        sample_tool.sample(m, tokenizer, "Once upon", 12, seed=s)
        for m, s in [(rebuilt, 0), (model, 0), (rebuilt, 1)]
    ]
    assert texts[0] == texts[1] != texts[2]
    # transformers' KV cache draws what the recomputed prefix draws, past the context (64) too.
    for n in (12, 70):
        with_cache = sample_tool.sample(rebuilt, tokenizer, "Once upon", n, seed=0)
        assert with_cache == sample_tool.sample(rebuilt, tokenizer, "Once upon", n, cache=False)
    assert with_cache.startswith(texts[0])
    expected = greedy(model, tokenizer, "Once upon", 12)
    assert sample_tool.sample(rebuilt, tokenizer, "Once upon", 12, top_k=1) == expected
    cold = sample_tool.sample(rebuilt, tokenizer, "Once upon", 12, top_k=2048, temperature=1e-6)
    assert cold == expected != texts[0]


@pytest.mark.parametrize("tool", [export_hf, sample_tool], ids=["export_hf", "sample"])
def test_a_checkpoint_that_is_not_there_is_one_line_and_status_2(tool, tmp_path, capsys):
    argv = [str(tmp_path / "nothing")] + ([str(tmp_path / "hf")] if tool is export_hf else [])
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    name = "export_hf.py" if tool is export_hf else "sample.py"
    expected = f"{name}: error: no checkpoint folder at {tmp_path / 'nothing'}\n"
    assert capsys.readouterr().err == expected
