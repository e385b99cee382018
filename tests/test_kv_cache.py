"""The KV cache (kv_cache.py, from step 3): generation that feeds each token once gives the tokens
and the logits of generation that recomputes the whole prefix, and transformers' generate on the
same weights; under tp 2 x pp 2 the end-of-run sample, drawn with the cache, is tools/sample.py's
draw from the checkpoint, by transformers' model without a cache."""

import ast
import sys

import pytest
import torch
import transformers
from conftest import ROOT, TINY, check, import_step, run_step

sys.path.insert(0, str(ROOT / "tools"))
import sample as sample_tool  # noqa: E402

S3 = "step3_dataloader"
PROMPT = [5, 17, 300, 42, 7, 1000, 3]


def config(**change):
    """Llama with grouped-query attention (4 query heads, 2 key/value heads), llama3 RoPE."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope["original_max_position_embeddings"] = 32
    fields = dict(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_parameters=rope, tie_word_embeddings=False)  # fmt: skip
    return transformers.LlamaConfig(**{**fields, **change})


@pytest.fixture(scope="module")
def ours():
    model_lib = import_step(S3, "model")
    model = model_lib.LlamaForCausalLM(config()).eval()
    model.init_weights(seed=3)
    torch.manual_seed(0)
    with torch.no_grad():  # weights far from the initial ones: the norms not all ones
        for param in model.parameters():
            param.mul_(torch.empty_like(param).uniform_(0.5, 6.0))
    return model


@torch.no_grad()
def greedy(model, n, cached):
    """n tokens after PROMPT, the likeliest each time; and the last position's logits of each."""
    kv_cache = import_step(S3, "kv_cache").kv_cache
    ids = new = torch.tensor([PROMPT])
    steps = []
    with kv_cache(model) if cached else torch.no_grad():
        for _ in range(n):
            logits = model(new if cached else ids)[:, -1]  # (1, V)
            steps.append(logits)
            new = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
    return ids[0, len(PROMPT) :].tolist(), torch.cat(steps)


def test_cached_generation_gives_the_recomputed_tokens_and_logits(ours):
    tokens, logits = greedy(ours, 40, cached=True)
    expected, expected_logits = greedy(ours, 40, cached=False)
    assert tokens == expected
    assert len(set(tokens)) > 5, tokens  # not one token over and over: the test would be weak
    scale = expected_logits.abs().max()  # rounding of another order of the same sums: 1e-6 of it
    assert (logits - expected_logits).abs().max() < 1e-5 * scale


def test_cached_generation_equals_transformers_generate(ours):
    theirs = transformers.LlamaForCausalLM(config()).eval()
    theirs.load_state_dict(ours.state_dict())
    generated = theirs.generate(
        torch.tensor([PROMPT]),
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        max_new_tokens=40,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
    assert greedy(ours, 40, cached=True)[0] == generated[0, len(PROMPT) :].tolist()


@torch.no_grad()
def test_several_new_tokens_at_once_see_the_cache_and_each_other(ours):
    """After a cached prefix, a call with 3 new tokens gives the logits of the whole sequence
    at once: each new token attends to the cached ones and the new ones before it."""
    kv_cache = import_step(S3, "kv_cache").kv_cache
    ids = torch.tensor([PROMPT + [11, 12, 13]])
    with kv_cache(ours) as cache:
        ours(ids[:, :-3])
        logits = ours(ids[:, -3:])  # (1, 3, V)
        assert len(cache) == 3 and cache[ours.model.layers[0].self_attn][0].shape == (1, 2, 10, 16)
    expected = ours(ids)[:, -3:]
    assert (logits - expected).abs().max() < 1e-5 * expected.abs().max()
    assert not any("forward" in vars(m) for m in ours.modules())  # the layers' own forward back


def test_under_tp2_pp2_the_sample_is_the_checkpoints_draw_without_cache(tmp_path):
    """Step 9 at tp 2 x pp 2 trains two steps and samples 24 tokens with the cache (each tp rank
    caching its heads, each stage its layers); tools/sample.py draws from the saved weights with
    the same seed, top-k and temperature, recomputing the prefix with transformers' model."""
    args = [*TINY, "--max_steps", "2", "--num_proc", "1", "--eval_steps", "1"]
    args += ["--tp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b", "--sample_tokens", "24"]
    args += ["--save_dir", str(tmp_path / "run"), "--learning_rate", "3e-2"]
    result = check(run_step("step9_3d_parallel", args, nproc=4))
    logged = ast.literal_eval(result.stdout.split("sample: ")[1].splitlines()[0])  # its repr
    state_dict, hf_config = sample_tool.load_merged_state_dict(str(tmp_path / "run"), None)
    model = sample_tool.build_model(state_dict, hf_config, torch.device("cpu"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(ROOT / "assets/tokenizers/tinytales")
    drawn = sample_tool.sample(model, tokenizer, "Once upon a time", 24, seed=42)
    assert drawn == logged
    assert len(tokenizer.encode(logged)) > len(tokenizer.encode("Once upon a time")) + 10
