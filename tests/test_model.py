"""The step-1 model against transformers' LlamaForCausalLM: same keys, same logits, same loading."""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import ROOT, import_step

model_lib = import_step("step1_model", "model")

SHAPES = [
    # (heads, kv heads, tied, rope_theta)
    (4, 4, False, 10000.0),  # multi-head
    (4, 2, True, 500000.0),  # grouped-query, tied embeddings, another RoPE base
    (8, 1, False, 10000.0),  # multi-query
]


def hf_config(heads, kv_heads, tied, theta, **extra):
    return transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        rope_theta=theta,
        max_position_embeddings=64,
        **extra,
    )


@pytest.mark.parametrize("heads, kv_heads, tied, theta", SHAPES)
def test_same_keys_and_logits_as_transformers(heads, kv_heads, tied, theta):
    config = hf_config(heads, kv_heads, tied, theta)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    model = model_lib.LlamaForCausalLM(config)
    assert model.state_dict().keys() == reference.state_dict().keys()
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (3, 17))
    expected = reference(input_ids).logits
    torch.testing.assert_close(model(input_ids), expected, rtol=1e-5, atol=1e-5)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loads_a_transformers_checkpoint_from_disk(tmp_path):
    """save_pretrained writes safetensors without the tied lm_head; our model still loads it."""
    config = hf_config(4, 2, True, 10000.0)
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    from safetensors.torch import load_model

    model = model_lib.LlamaForCausalLM(config)
    load_model(model, str(tmp_path / "model.safetensors"), strict=False)
    model.tie_weights()
    input_ids = torch.randint(0, config.vocab_size, (2, 9))
    torch.testing.assert_close(model(input_ids), reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_head_dim_differs_from_hidden_over_heads():
    """Some Llama configs set head_dim explicitly; shapes must follow it, not hidden / heads."""
    config = hf_config(4, 2, False, 10000.0, head_dim=8)
    torch.manual_seed(2)
    reference = transformers.LlamaForCausalLM(config).eval()
    model = model_lib.LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 11))
    torch.testing.assert_close(model(input_ids), reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def build(config, seed):
    with torch.device("meta"):
        model = model_lib.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed)
    return model


def test_init_is_a_function_of_seed_and_name():
    config = hf_config(4, 2, False, 10000.0)
    a, b, c = build(config, 7), build(config, 7), build(config, 8)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - config.initializer_range) < 0.003, name
            # The value can be made alone, from the name and the seed, without the model.
            alone = model_lib.initial_value(name, pa.shape, config.initializer_range, 7)
            assert torch.equal(pa, alone), name
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name
    # Two parameters of the same shape get different values.
    q0 = a.model.layers[0].self_attn.q_proj.weight
    q1 = a.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(q0, q1)


def test_init_is_the_same_with_fewer_layers():
    """A pipeline stage holds some layers only; their weights must not depend on the others."""
    full = build(hf_config(4, 2, False, 10000.0), 3)
    config = hf_config(4, 2, False, 10000.0)
    config.num_hidden_layers = 1
    short = build(config, 3)
    for name, param in short.named_parameters():
        assert torch.equal(param, full.get_parameter(name)), name


def test_tied_init_survives_meta_build():
    model = build(hf_config(4, 2, True, 10000.0), 5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = model_lib.initial_value("model.embed_tokens.weight", (101, 64), 0.02, 5)
    assert torch.equal(model.lm_head.weight, expected)


def test_a_sliced_module_initialises_its_slice():
    """A module with init_parameter receives the full parameter's maker and keeps its slice."""
    config = hf_config(4, 2, False, 10000.0)
    full = build(config, 11)

    class HalfRows(torch.nn.Linear):
        def init_parameter(self, name, make_full):
            return make_full((2 * self.out_features, self.in_features))[self.out_features :]

    model = build(config, 11)
    mlp = model.model.layers[1].mlp
    mlp.up_proj = HalfRows(64, 48, bias=False)
    model.init_weights(11)
    assert torch.equal(mlp.up_proj.weight, full.model.layers[1].mlp.up_proj.weight[48:])


# Tiny versions of every shipped config family, and the RoPE scalings: (config fields, the token
# ids the batch must contain). Each differs from the defaults where its family does.
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
FAMILIES = {
    # SmolLM: tied embeddings, grouped-query attention
    "smollm": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # TinyLlama: grouped-query attention, untied
    "tinyllama": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    # Llama 3.2: tied, grouped-query, Llama 3 RoPE scaling with theta 500000. The original context
    # of 64 puts a head dim of 16's frequencies in all three bands (see the next test).
    "llama3.2": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE,
    ),  # fmt: skip
    "linear_rope": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    # A pad token: transformers' embedding gives its row no gradient from its lookups.
    "pad_token": dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=7),
}


def family_config(family):
    shape = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    return transformers.LlamaConfig(
        **shape, max_position_embeddings=128, rms_norm_eps=1e-5, **FAMILIES[family]
    )


def random_weights(model, seed):
    """Weights far from the initial ones (norms not all one, activations of order one), so that
    every gradient is large enough for a relative tolerance to mean something."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def parity(config, seed=0, length=31):
    """Our model and transformers' with the same weights on one batch: the logits, and every
    parameter's gradient of the cross-entropy. Returns the largest differences."""
    reference = transformers.LlamaForCausalLM(config)  # train mode: dropout would show
    random_weights(reference, seed)
    model = model_lib.LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (2, length), generator=generator)
    targets = torch.randint(0, config.vocab_size, (2, length), generator=generator)
    if config.pad_token_id is not None:
        input_ids[:, ::5] = config.pad_token_id
    expected = reference(input_ids).logits
    logits = model(input_ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    F.cross_entropy(expected.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    max_grad = 0.0
    names = {name for name, _ in reference.named_parameters()}
    assert names == {name for name, _ in model.named_parameters()}  # tied: lm_head left out
    for name, param in model.named_parameters():
        want = reference.get_parameter(name).grad
        torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-5, msg=name)
        max_grad = max(max_grad, (param.grad - want).abs().max().item())
    return (logits - expected).abs().max().item(), max_grad


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_transformers(family):
    config = family_config(family)
    max_logits, max_grad = parity(config)
    print(f"{family}: max |dlogits| {max_logits:.1e}, max |dgrad| {max_grad:.1e}")


def test_llama3_scaling_changes_some_frequencies_only():
    """At head dim 16 with theta 500000 and an original context of 64 tokens, the fastest
    frequency is kept, the next is blended and the slower ones are divided by `factor`: the
    parity test above covers all three bands of the scaling."""
    config = family_config("llama3.2")
    rope = model_lib.rope_parameters(config)
    scaled = model_lib.rope_frequencies(16, rope, "cpu")
    plain = model_lib.rope_frequencies(16, {**rope, "rope_type": "default"}, "cpu")
    ratio = plain / scaled
    assert ratio[0] == 1.0
    assert 1.0 < ratio[1] < 32.0
    torch.testing.assert_close(ratio[2:], torch.full((6,), 32.0))
    reference = transformers.LlamaForCausalLM(config)
    torch.testing.assert_close(scaled, reference.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)


def test_transformers_4_style_rope_fields():
    """transformers 4 keeps rope_theta on the config and the scaling in rope_scaling, whose type
    was first called `type`: a config object of that shape gives the same model."""
    config = family_config("linear_rope")
    old_style = SimpleNamespace(**config.to_dict())
    del old_style.rope_parameters
    old_style.rope_theta, old_style.rope_scaling = 10000.0, {"type": "linear", "factor": 4.0}
    assert model_lib.rope_parameters(old_style)["rope_type"] == "linear"
    reference = transformers.LlamaForCausalLM(config).eval()
    model = model_lib.LlamaForCausalLM(old_style)
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 33))
    torch.testing.assert_close(model(input_ids), reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_llama_3_2_1b_config():
    """The shipped config, as a Llama 3.2 1B checkpoint's config.json states it, builds the
    published 1.24 B parameters with the Llama 3 RoPE scaling."""
    config = transformers.AutoConfig.from_pretrained(ROOT / "assets/configs/llama-3.2-1b")
    rope = model_lib.rope_parameters(config)
    assert rope == {**LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192}
    with torch.device("meta"):
        model = model_lib.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert model.lm_head.weight is model.model.embed_tokens.weight


# Each field that this model would compute differently from transformers, with a value it refuses.
REFUSED = [
    ("attention_bias", True),
    ("mlp_bias", True),
    ("hidden_act", "gelu"),
    ("hidden_act", "relu"),
    ("attention_dropout", 0.1),
    ("is_causal", False),
    ("pad_token_id", 101),
    ("rope_type", "dynamic"),
    ("rope_type", "yarn"),
    ("rope_type", "longrope"),
    ("partial_rotary_factor", 0.5),
    ("high_freq_factor", 1.0),
]


@pytest.mark.parametrize("field, value", REFUSED, ids=lambda v: str(v))
def test_refuses_what_it_would_compute_differently(field, value):
    config = family_config("llama3.2")
    if field in ("rope_type", "partial_rotary_factor", "high_freq_factor"):
        config.rope_parameters = {**config.rope_parameters, field: value}
    else:
        setattr(config, field, value)
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        with torch.device("meta"):  # as the steps build it: before any weight exists
            model_lib.LlamaForCausalLM(config)
