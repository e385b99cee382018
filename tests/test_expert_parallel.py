"""Step 15: a mixture of experts and expert parallelism. The MoE model against transformers'
Mixtral (logits, loss, the load-balancing loss; a checkpoint both ways); the router's losses
linear in the sequences, where transformers' pooled one is not; the all-to-all exchange against
one rank, forward and backward, and the bugs it guards against; the layouts train like the same
MoE on one process, and the bugs injected there fail; what cannot work is refused."""

import json
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
import transformers
from conftest import (
    ROOT,
    TINY,
    assert_refused,
    check,
    import_step,
    read_log,
    run_step,
    spawn,
    step_dir,
)

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402
import export_hf  # noqa: E402
import sample  # noqa: E402

S15 = "step15_expert_parallel"
moe_lib = import_step(S15, "moe")
model_lib = import_step(S15, "model")
hf_import = import_step(S15, "hf_import")


pgm_lib = import_step(S15, "process_group_manager")


@pytest.mark.parametrize("dp, ep, pp, cp, tp", [(4, 2, 1, 2, 1), (4, 4, 2, 1, 1), (6, 3, 1, 1, 2)])
def test_the_expert_layout_is_the_dense_grid_with_dp_folded_into_edp_and_ep(dp, ep, pp, cp, tp):
    """The expert layers' groups come from the declared EXPERT_AXES by the same `grid` and
    `group_ranks` as the dense ones; checked against the definition, rank by rank: dp rank =
    edp_rank * ep_size + ep_rank, the other coordinates the dense grid's. A group is the ranks
    that share every coordinate but its axes'."""
    world = dp * pp * cp * tp
    sizes = (world, tp, pp, dp, cp, ep)
    dense, expert = (pgm_lib.grid(*sizes, layout=layout) for layout in pgm_lib.LAYOUTS)
    where = {}  # rank: its coordinates, by the definition
    for rank in range(world):
        d, p, c, t = (dense == rank).nonzero()[0].tolist()
        where[rank] = {"edp": d // ep, "ep": d % ep, "pp": p, "cp": c, "tp": t}
    for axes in [("ep",), ("edp",), ("edp", "cp"), ("ep", "pp")]:
        got = pgm_lib.group_ranks(expert, *axes, layout=pgm_lib.EXPERT_AXES).tolist()
        others = [axis for axis in pgm_lib.EXPERT_AXES if axis not in axes]
        want = {}
        for rank in range(world):
            want.setdefault(tuple(where[rank][a] for a in others), []).append(rank)
        assert sorted(got) == sorted(want.values()), (axes, got, want)
    assert pgm_lib.layout_of(["edp", "cp"]) == pgm_lib.EXPERT_AXES
    assert pgm_lib.layout_of(["dp", "cp"]) == pgm_lib.AXES
    with pytest.raises(ValueError, match="no layout has the axes dp, ep"):
        pgm_lib.layout_of(["dp", "ep"])


def mixtral_config(**extra):
    return transformers.MixtralConfig(
        **{
            "vocab_size": 101,
            "hidden_size": 64,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            **extra,
        }
    )


def ours_from(reference):
    """Our MoE model with the weights of transformers' Mixtral `reference` (which holds each
    layer's experts fused: gate_up_proj (E, 2F, D), down_proj (E, D, F))."""
    config = reference.config
    model = model_lib.LlamaForCausalLM(config)
    moe_lib.apply_moe(model)
    state, F_ = {}, config.intermediate_size
    for key, value in reference.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            for e in range(config.num_local_experts):
                state[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = value[e, :F_]
                state[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = value[e, F_:]
        elif key.endswith("experts.down_proj"):
            for e in range(config.num_local_experts):
                state[key.replace("down_proj", f"{e}.down_proj.weight")] = value[e]
        else:
            state[key] = value
    model.load_state_dict(state)
    return model.eval()


def router_inputs(model, ids):
    """The first layer's router inputs, for `ids`: the post-attention norm's output."""
    x = model.model.embed_tokens(ids)
    layer = model.model.layers[0]
    x = x + layer.self_attn(layer.input_layernorm(x))
    return layer.post_attention_layernorm(x)


def balance_loss(model, ids):
    """Our first layer's load-balancing loss alone (coefficient 1, no z-loss), and its logits."""
    moe = model.model.layers[0].mlp
    moe.aux_loss_coef, moe.z_loss_coef = 1.0, 0.0
    logits = moe.gate(router_inputs(model, ids)).float()
    probs = logits.softmax(dim=-1)
    index = probs.topk(moe.top_k, dim=-1).indices
    return moe.router_losses(logits, probs, index), logits


def test_logits_and_losses_equal_transformers_mixtral():
    torch.manual_seed(0)
    reference = transformers.MixtralForCausalLM(mixtral_config()).eval()
    model = ours_from(reference)
    ids = torch.randint(0, 101, (3, 17))
    expected = reference(ids, labels=ids)
    logits = model(ids)
    # Each expert's gate and up are one fused matmul in transformers, two here: the sums agree
    # to the last bits, not always bit for bit (0.0 apart here; 3.0e-8 with one layer and a
    # sequence of its own, on the 2-core machine).
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-6)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, expected.loss, rtol=1e-6, atol=0)
    # One layer and one sequence: transformers' pooled load-balancing loss is ours.
    one = transformers.MixtralForCausalLM(mixtral_config(num_hidden_layers=1)).eval()
    mine = ours_from(one)
    for row in ids:
        ours, _ = balance_loss(mine, row[None])
        theirs = one(row[None], output_router_logits=True).aux_loss
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_router_losses_are_means_of_per_sequence_terms_and_transformers_is_not():
    """Ours over 4 sequences is the mean of ours over each: what dp ranks, micro-batches and
    stages add up. transformers pools the batch's counts and probabilities: over the same 4
    sequences its loss is not the mean of its per-sequence losses, so no rank could add its
    share."""
    torch.manual_seed(1)
    one = transformers.MixtralForCausalLM(mixtral_config(num_hidden_layers=1)).eval()
    model = ours_from(one)
    ids = torch.randint(0, 101, (4, 17))
    ours, logits = balance_loss(model, ids)
    alone = torch.stack([balance_loss(model, row[None])[0] for row in ids])
    torch.testing.assert_close(ours, alone.mean(), rtol=1e-6, atol=0)
    pooled = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    theirs = pooled((logits.view(-1, 4),), 4, 2)
    theirs_alone = torch.stack([pooled((logits[b],), 4, 2) for b in range(4)])
    gap = (theirs - theirs_alone.mean()).abs().item()
    print(f"\npooled {theirs.item():.6f}, mean of per-sequence {theirs_alone.mean().item():.6f}")
    assert gap > 1e-3, gap
    # The z-loss: the mean over tokens of logsumexp(logits)^2.
    moe = model.model.layers[0].mlp
    moe.aux_loss_coef, moe.z_loss_coef = 0.0, 1.0
    probs = logits.softmax(-1)
    z = moe.router_losses(logits, probs, probs.topk(2, -1).indices)
    torch.testing.assert_close(z, torch.logsumexp(logits, -1).pow(2).mean(), rtol=1e-6, atol=0)


def test_the_router_losses_reach_the_router_through_any_output():
    """AttachLoss: the layer's output carries the losses; backward from the output alone gives
    the router the losses' gradient, scaled, and records the value once."""
    torch.manual_seed(2)
    model = ours_from(transformers.MixtralForCausalLM(mixtral_config()).eval()).train()
    moe = model.model.layers[0].mlp
    x = router_inputs(model, torch.randint(0, 101, (2, 9))).detach()
    moe.aux_loss_coef, moe.z_loss_coef, moe.scale = 0.5, 0.25, 1.0
    moe(x).sum().backward()
    with_losses = moe.gate.weight.grad.clone()
    moe.gate.weight.grad = None
    moe.aux_loss_coef = moe.z_loss_coef = 0.0
    moe(x).sum().backward()
    without = moe.gate.weight.grad.clone()
    moe.gate.weight.grad = None
    logits = moe.gate(x).float()
    probs = logits.softmax(-1)
    moe.aux_loss_coef, moe.z_loss_coef = 0.5, 0.25
    moe.router_losses(logits, probs, probs.topk(2, -1).indices).backward()
    torch.testing.assert_close(with_losses - without, moe.gate.weight.grad, rtol=1e-5, atol=1e-8)
    assert len(moe.record) == 2  # the two backwards through the layer


def test_the_router_flags_reach_the_logged_loss(tmp_path):
    """--aux_loss_coef and --z_loss_coef, end to end: the router loss logged at step 1 (the same
    weights and batch in every run) is aux x the balancing loss + z x the z-loss, the formula on
    one process. Zero with both at 0; each alone above 0; together, the weighted sum of the two
    (so a flag that set_router_losses ignores, or reads into the other, fails)."""
    run = [*TINY, *MOE, "--max_steps", "1", "--gradient_accumulation_steps", "2"]
    run += ["--eval_every", "0", "--sample_tokens", "0", "--num_proc", "1"]
    logged = {}
    for aux, z in [(0, 0), (1, 0), (0, 1), (0.5, 0.25)]:
        log_file = tmp_path / f"aux{aux}_z{z}.jsonl"
        flags = ["--aux_loss_coef", str(aux), "--z_loss_coef", str(z), "--log_file", str(log_file)]
        check(run_step(S15, [*run, *flags], env=ENV))
        logged[aux, z] = read_log(log_file)[0]["router_loss"]
    balance, z_loss = logged[1, 0], logged[0, 1]
    assert logged[0, 0] == 0.0 and balance > 0 and z_loss > 0, logged
    assert logged[0.5, 0.25] == pytest.approx(0.5 * balance + 0.25 * z_loss, rel=1e-6), logged


def test_a_checkpoint_goes_to_transformers_and_back(tmp_path):
    """A run's checkpoint, exported, loads in MixtralForCausalLM; --init_from_hf's reader loads
    that folder into our model, and tools/sample.py the checkpoint itself: the same logits."""
    run = tmp_path / "run"
    args = [*TINY, "--model_name", "tiny-moe", "--max_steps", "2", "--save_dir", str(run)]
    check(run_step(S15, [*args, "--save_every", "2", "--sample_tokens", "0"]))
    export_hf.export(run, tmp_path / "hf")
    reference = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model = model_lib.LlamaForCausalLM(reference.config)
    moe_lib.apply_moe(model)
    hf_import.load_hf_weights(model, tmp_path / "hf")
    ids = torch.randint(0, reference.config.vocab_size, (2, 16))
    # tools/sample.py merges the run's checkpoint itself and fuses the experts as transformers
    # holds them: the same model.
    merged = sample.build_model(*export_hf.load_merged_state_dict(run), torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), reference(ids).logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)


### The exchange across ranks
def exchange_worker(rank, world, out, bug):
    """Each rank its own tokens; every expert on one rank (the reference) against E/2 experts
    per rank with the all-to-all. `bug`: None, or "plain" (an all-to-all autograd cannot see)."""
    import expert_parallel
    import moe as moe_lib
    from process_group_manager import ProcessGroupManager

    torch.manual_seed(0)  # the same layer on every rank
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2
    )
    layer = moe_lib.MixtureOfExperts(config, range(4))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.5)
    torch.manual_seed(1 + rank)  # each rank its tokens
    x = torch.randn(3, 5, 16)
    # No near-ties: the k-th and the next probability are far apart, so rounding cannot flip one.
    probs = layer.gate(x).float().softmax(-1).sort(-1, descending=True).values
    assert (probs[..., 1] - probs[..., 2]).min() > 1e-4
    reference = {}
    x_ref = x.clone().requires_grad_()
    y_ref = layer(x_ref)
    (y_ref * torch.arange(16.0)).sum().backward()
    for name, param in layer.named_parameters():
        reference[name] = param.grad.clone()
        if name.startswith("experts."):  # the expert's gradient: every rank's tokens
            dist.all_reduce(reference[name])
        param.grad = None
    pgm = ProcessGroupManager(1, 1, world, ep_size=world)
    if bug == "plain":
        expert_parallel.AllToAll.apply = expert_parallel.all_to_all
    mine = range(pgm.ep_rank * 2, pgm.ep_rank * 2 + 2)
    layer.experts = torch.nn.ModuleDict({str(e): layer.experts[str(e)] for e in mine})
    layer.exchange = partial(expert_parallel.exchange, pgm.ep_group)
    x_ep = x.clone().requires_grad_()
    y = layer(x_ep)
    (y * torch.arange(16.0)).sum().backward()

    def relative(got, want):  # the largest difference, relative to the largest value
        got = torch.zeros_like(want) if got is None else got
        return ((got - want).abs().max() / want.abs().max()).item()

    worst = {"output": relative(y, y_ref), "input": relative(x_ep.grad, x_ref.grad)}
    for name, param in layer.named_parameters():
        worst[name] = relative(param.grad, reference[name])
    (out / f"rank{rank}.json").write_text(json.dumps(worst))


@pytest.mark.parametrize("bug", [None, "plain"])
def test_the_exchange_computes_what_one_rank_computes(tmp_path, bug):
    """2 ranks, 2 experts each: the output and every gradient (input, router, experts) of the
    layer as one rank with all 4 experts computes them (each expert's gradient summed over the
    ranks' tokens), to 1e-6 of the largest value. With PyTorch's plain all_to_all_single, which
    autograd cannot see, the experts and the input's expert path get no gradient: it tells."""
    spawn(S15, exchange_worker, 2, tmp_path, tmp_path, bug)
    worst = {}
    for rank in range(2):
        for name, value in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            worst[name] = max(worst.get(name, 0.0), value)
    print(f"\n{bug}: {worst}")
    assert worst["output"] <= 1e-6
    wrong = {name: value for name, value in worst.items() if value > 1e-6}
    if bug is None:
        assert not wrong, wrong
    else:
        assert "input" in wrong and any(name.startswith("experts.") for name in wrong), worst


def test_the_all_to_all_bytes_follow_the_formula():
    """--comm_stats at ep 2: per layer and micro-batch, five all-to-alls (the counts, dispatch
    and combine, each of the two again in backward). Dispatch carries a rank's N k rows and
    combine the R rows it computed for the others and itself; backward the same again: over the
    ep ranks, whose R add up to ep N k, 4 ep N k D 4 bytes, and the counts 8 E ep. At ep 2 both
    ranks send as much: each sends, four times, the rows that cross between them."""
    L, m, N, k, D, E, ep = 2, 2, 2 * 32, 2, 64, 4, 2  # TINY: 2 layers, 2 rows of 32, hidden 64
    flags = [*TINY, *MOE, "--dp_size", "2", "--ep_size", "2", "--comm_stats"]
    flags += ["--gradient_accumulation_steps", str(m), "--max_steps", "1", "--sample_tokens", "0"]
    result = check(run_step(S15, flags, nproc=2))
    rows = [line.split() for line in result.stdout.splitlines() if " all-to-all " in line]
    assert len(rows) == ep, result.stdout[-3000:]
    calls = {int(row[-3]) for row in rows}
    total = sum(int(row[-2].replace(",", "")) for row in rows)
    sent = [int(row[-1].replace(",", "")) for row in rows]
    assert calls == {5 * L * m}
    assert total == L * m * (4 * ep * N * k * D * 4 + 8 * E * ep)
    assert sent[0] == sent[1] and 0 < sent[0] < total / ep


### The layouts
def llama4_block(top_k):
    """transformers' Llama4TextMoe with random weights, and our MixtureOfExperts under
    --moe_router llama4 with the same: the router, each expert's gate, up and down (transformers
    holds them fused, gate_up_proj (E, D, 2F) and down_proj (E, F, D), as x @ W), the shared
    expert."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=top_k
    )
    theirs = transformers.models.llama4.modeling_llama4.Llama4TextMoe(config)
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.2)
    config.moe_router = "llama4"
    ours = moe_lib.MixtureOfExperts(config, range(4))
    F_, experts = config.intermediate_size, theirs.experts
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.router.weight)
        for e, expert in ours.experts.items():
            gate_up, down = experts.gate_up_proj[int(e)], experts.down_proj[int(e)]
            expert.gate_proj.weight.copy_(gate_up[:, :F_].T)
            expert.up_proj.weight.copy_(gate_up[:, F_:].T)
            expert.down_proj.weight.copy_(down.T)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(
                getattr(theirs.shared_expert, name).weight
            )
    return theirs, ours


def scaled_close(got, want, rel=1e-5):
    """Within `rel` of the largest of `want`: the gradients' scales run over many decades, and
    the fused and separate matmuls round an element near zero apart by more than 1e-5 of it."""
    assert got.shape == want.shape
    assert (got - want).abs().max() <= rel * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_llama4_router_computes_what_transformers_llama4_computes(top_k):
    """Block against block, top-1 (as Llama 4 ships) and top-2: the output, the input's gradient
    and every weight's, to float32's rounding (transformers runs every token through every
    expert, zero-weighted where not chosen; ours only the chosen slots). The router learns at
    top-1: its gradient is not zero."""
    torch.manual_seed(top_k)
    theirs, ours = llama4_block(top_k)
    x = torch.randn(3, 11, 64)
    grad = torch.randn(3, 11, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = theirs(x1)[0].view(3, 11, 64)
    got = ours(x2)
    scaled_close(got, expected)
    expected.backward(grad)
    got.backward(grad)
    scaled_close(x2.grad, x1.grad)
    scaled_close(ours.gate.weight.grad, theirs.router.weight.grad)
    assert ours.gate.weight.grad.abs().sum() > 0
    F_, fused = 48, theirs.experts
    for e, expert in ours.experts.items():
        gate_up, down = fused.gate_up_proj.grad[int(e)], fused.down_proj.grad[int(e)]
        scaled_close(expert.gate_proj.weight.grad, gate_up[:, :F_].T)
        scaled_close(expert.up_proj.weight.grad, gate_up[:, F_:].T)
        scaled_close(expert.down_proj.weight.grad, down.T)
    for name in ("gate_proj", "up_proj", "down_proj"):
        want = getattr(theirs.shared_expert, name).weight.grad
        scaled_close(getattr(ours.shared_expert, name).weight.grad, want)


LLAMA4 = ["--model_name", "tiny-moe", "--moe_router", "llama4", "--max_steps", "4"]


def test_the_llama4_router_trains_like_one_process_under_ep_tp_sp_and_zero3(tmp_path):
    """--moe_router llama4 on one process, against ep 2 over dp 2 with tp 2 and sequence
    parallelism (the shared expert whole on every rank, its gradient summed over tp like the
    router's), and ep 2 over dp 2 under ZeRO-3 (the shared expert sharded with the layer's
    dense unit): the same losses and gradient norms (the harness's tolerances), router losses
    and expert loads."""
    common = [*COMMON, *LLAMA4]
    base = convergence.Layout("llama4_baseline", str(step_dir(S15)), 1, (), 4)
    layouts = [
        convergence.Layout(
            "ep2_tp2_sp", str(step_dir(S15)), 4,
            ("--tp_size", "2", "--dp_size", "2", "--ep_size", "2", "--sequence_parallel"), 2,
        ),
        convergence.Layout(
            "ep2_zero3", str(step_dir(S15)), 2,
            ("--dp_size", "2", "--ep_size", "2", "--zero_stage", "3"), 2,
        ),
    ]  # fmt: skip
    want = convergence.run(base, common, tmp_path, env=ENV)
    assert len(want) == 4
    for layout in layouts:
        got = convergence.run(layout, common, tmp_path, env=ENV)
        comparison = convergence.compare(got, want)
        assert comparison.ok, f"{layout.name}: {comparison.problems}"
        for g, w in zip(got, want, strict=True):
            assert g["router_loss"] == pytest.approx(w["router_loss"], rel=1e-5)
            assert g["expert_load"] == w["expert_load"], layout.name


def test_the_llama4_router_is_refused_where_it_would_be_read_as_mixtral(tmp_path):
    """transformers' Mixtral has no place for the sigmoid router's shared expert: a checkpoint
    of it is not exported, and --save_dynamics (which captures through that export) is refused
    before the first step; one line each."""
    save = tmp_path / "run"
    args = [*TINY, *LLAMA4, "--max_steps", "1", "--sample_tokens", "0", "--save_dir", str(save)]
    result = run_step(S15, [*args, "--save_dynamics"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (
        "--moe_router llama4 with --save_dynamics: that reads or writes the model as "
        + ("transformers' Mixtral, which has no Llama 4 router nor shared expert")
        in result.stderr
    ), result.stderr[-2000:]
    assert not (save / "step_000001").exists()
    check(run_step(S15, args))
    with pytest.raises(ValueError, match="routes its experts as Llama 4 does"):
        export_hf.load_merged_state_dict(save / "step_000001")


MOE = ["--model_name", "tiny-moe"]
EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"  # held by ep rank 1 of 2
COMMON = [*TINY, "--max_steps", "6", "--eval_every", "3", "--eval_steps", "2"]
COMMON += ["--num_proc", "1", "--sample_tokens", "4"]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
BASELINE = convergence.Layout("moe_baseline", S15, 1, (), 4)


class Trained(dict):
    """The MoE on one process ("baseline") and the manifest's step-15 layouts, 4 micro-batches
    in all, each trained the first time a test asks for it, once for the module."""

    def __init__(self, out):
        super().__init__()
        self.out = out
        self.layouts = {"baseline": BASELINE}
        self.layouts.update({lay.name: lay for lay in convergence.step_layouts(15, 4)})

    def __missing__(self, name):
        # The folder the tests use (a learner's copy, with --step): one process too. The
        # layouts name the model in their flags, the baseline here.
        layout = replace(self.layouts[name], step=str(step_dir(S15)))
        common = COMMON + (MOE if name == "baseline" else [])
        self[name] = convergence.run(layout, common, self.out, env=ENV)
        return self[name]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return Trained(tmp_path_factory.mktemp("layouts"))


def check_layout(trained, name):
    """The layout `name` against the MoE on one process: the loss, the gradient norm, the
    router's losses and the expert loads, each step."""
    comparison = convergence.compare(trained[name], trained["baseline"])
    assert comparison.ok, f"{name}: {comparison.problems}"
    for got, want in zip(trained[name], trained["baseline"], strict=True):
        assert abs(got["router_loss"] - want["router_loss"]) <= 1e-5 * want["router_loss"]
        assert got["expert_load"] == want["expert_load"], name
        # A capacity counts each rank's micro-batch: a cp rank holds half of its rows.
        if "cp" not in name:
            assert got["dropped_at_capacity_1.25"] == want["dropped_at_capacity_1.25"], name
    return comparison


def test_ep2_over_dp2_trains_like_one_process(trained):
    """The smallest layout of the technique (the quick tier's): the experts split over 2 ranks
    borrowed from dp 2, each expert's gradient averaged over the ranks that saw its tokens."""
    check_layout(trained, "ep2_dp2")


def test_every_layout_trains_like_one_process(trained):
    """ep 2 over dp 2, and over dp 4 (two ranks hold each expert); with tp 2; sequence
    parallelism (each tp rank routing its own tokens) at ep 1 and at ep 2; with pp 2 at
    1F1B, and at ZB-H1 with full recomputation; with ZeRO-2; the MoE under ZeRO-3 at ep 1, and
    at ep 2 over dp 4 with full recomputation (each expert's rows cut over its two ranks); cp 2,
    at ep 1 and at ep 2 (each sequence's load-balancing counts summed over its chunks): against
    the MoE on one process, the router's losses and the expert loads too."""
    names = [layout.name for layout in convergence.step_layouts(15, 4)]
    results = {name: convergence.compare(trained[name], trained["baseline"]) for name in names}
    print(f"\n{convergence.table(results)}")
    for name in names:
        check_layout(trained, name)
    assert 0.0 < trained["baseline"][0]["dropped_at_capacity_1.25"] < 1.0


EXPERTS_OVER_EDP = """
import zero

correct = zero.ShardedBucket.__init__

def __init__(self, params, dp_group, stage=1, replicas=None):
    correct(self, params, dp_group, stage)  # the bug: an expert's averaged over edp x cp alone

zero.ShardedBucket.__init__ = __init__
"""
POOLED_PER_RANK = """
import torch
import moe

def router_losses(self, logits, probs, index):
    # The bug: transformers' pooled loss, over this rank's whole micro-batch.
    B, T, E = probs.shape
    slots = torch.zeros(E).index_add_(0, index.reshape(-1), torch.ones(index.numel()))
    balance = E * (slots / (B * T) * probs.mean(dim=(0, 1))).sum()
    return self.aux_loss_coef * balance

moe.MixtureOfExperts.router_losses = router_losses
"""


@pytest.mark.parametrize(
    "bug, patch", [("experts_over_edp", EXPERTS_OVER_EDP), ("pooled_per_rank", POOLED_PER_RANK)]
)
def test_a_bug_injected_fails_the_comparison(tmp_path, trained, bug, patch):
    """ep 2 over dp 2 with an expert's gradient divided by the ranks that hold it (1) instead
    of dp (2); with the load-balancing loss pooled over each rank's micro-batch of 2 sequences
    (transformers' way; the coefficient 1.0 in both runs): the loss or the gradient norm leaves
    the one-process run's."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        convergence.LAUNCHER.format(bug=bug) + patch + "\nimport train\n\ntrain.main()\n"
    )
    [layout] = [lay for lay in convergence.step_layouts(15, 4) if lay.name == "ep2_dp2"]
    common, base = COMMON, trained["baseline"]
    if bug == "pooled_per_rank":  # a coefficient that weighs, the baseline with it too
        common = [*COMMON, "--aux_loss_coef", "1.0"]
        base = convergence.run(BASELINE, [*common, *MOE], tmp_path / "base", env=ENV)
    records = convergence.run(layout, common, tmp_path, env=ENV, launcher=launcher)
    comparison = convergence.compare(records, base)
    print(f"\n{convergence.table({f'ep2_dp2 + {bug}': comparison})}")
    assert not comparison.ok


def test_a_checkpoint_of_experts_on_two_ranks_resumes_in_any_layout(tmp_path):
    """Saved at step 2 by ep 2 over dp 4 with ZeRO-3 (each expert's rows cut over its two
    ranks), the balancing bias moving; steps 3 and 4 on one process with every expert, at ep 2
    over dp 2 with ZeRO-1, and at ep 4 over dp 4, are the saving run's."""
    common = [*TINY, *MOE, "--max_steps", "4", "--eval_every", "0", "--sample_tokens", "0"]
    common += ["--num_proc", "1", "--expert_bias_rate", "0.01"]  # the bias, in the checkpoint
    save, log = tmp_path / "saved", tmp_path / "saved.jsonl"
    args = [*common, "--dp_size", "4", "--ep_size", "2", "--zero_stage", "3"]
    args += ["--gradient_accumulation_steps", "1", "--save_every", "2", "--save_dir", str(save)]
    check(run_step(S15, [*args, "--log_file", str(log)], nproc=4))
    first = read_log(log)
    index = json.loads((save / "step_000002" / "index.json").read_text())
    files = {piece["file"] for piece in index["model"][EXPERT]["pieces"]}
    assert len(files) == 2, files  # rows cut over the edp ranks of ep rank 1
    for name, flags, nproc in [
        ("one", ["--gradient_accumulation_steps", "4"], 1),
        ("ep2_dp2", ["--dp_size", "2", "--ep_size", "2", "--gradient_accumulation_steps", "2"], 2),
        ("ep4_dp4", ["--dp_size", "4", "--ep_size", "4", "--gradient_accumulation_steps", "1"], 4),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "step_000002").symlink_to(save / "step_000002")
        (folder / "latest").write_text("step_000002")
        log = tmp_path / f"{name}.jsonl"
        args = [*common, *flags, "--save_dir", str(folder), "--resume", "--log_file", str(log)]
        check(run_step(S15, args, nproc=nproc))
        records = read_log(log)
        assert [r["step"] for r in records] == [3, 4]
        for got, want in zip(records, first[2:], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), name
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), name


BIAS_PER_MICRO_BATCH = """
import torch
import moe

correct = moe.MixtureOfExperts.route

def route(self, x):
    y = correct(self, x)
    if torch.is_grad_enabled():  # the bug: each micro-batch moves the bias, from its own rows
        experts = (x.float() @ self.gate.weight.float().t()).softmax(-1) + self.bias
        chosen = experts.topk(self.top_k, -1).indices.view(-1)
        counts = torch.bincount(chosen, minlength=len(self.bias))
        self.bias += 0.01 * torch.sign(counts.float().mean() - counts)
    return y

moe.MixtureOfExperts.route = route
moe.update_expert_bias = lambda *args: None
import train
"""


def test_the_balancing_bias_moves_once_per_step_from_the_whole_batch(tmp_path, trained):
    """--expert_bias_rate 0.01: ep 2 over dp 2 trains like one process with the same rate, and the
    bias changes the routing (the loads leave those of the run without it). Moved by each
    micro-batch from its own rows instead, on every rank, the runs part."""
    common = [*COMMON, "--expert_bias_rate", "0.01"]
    base = convergence.run(BASELINE, [*common, *MOE], tmp_path / "base", env=ENV)
    [layout] = [lay for lay in convergence.step_layouts(15, 4) if lay.name == "ep2_dp2"]
    comparison = convergence.compare(convergence.run(layout, common, tmp_path, env=ENV), base)
    assert comparison.ok, comparison.problems
    assert base[0]["expert_load"] == trained["baseline"][0]["expert_load"]  # zero at step 1
    assert base[-1]["expert_load"] != trained["baseline"][-1]["expert_load"]
    launcher = tmp_path / "launch.py"
    patch = BIAS_PER_MICRO_BATCH
    launcher.write_text(convergence.LAUNCHER.format(bug="bias") + patch + "\ntrain.main()\n")
    records = convergence.run(layout, common, tmp_path / "bug", env=ENV, launcher=launcher)
    buggy = convergence.compare(records, base)
    print(f"\n{convergence.table({'ep2_dp2 + the bias per micro-batch': buggy})}")
    assert not buggy.ok


def test_the_balancing_bias_is_training_state_not_read_from_the_log(tmp_path):
    """The bias moves on the device from the step's counts, whatever is printed: ep 2 over dp 2
    with --expert_bias_rate 0.01, the step line every step or every 10th, trains the same to the
    bit (every loss and gradient norm of the log file, and the router's statistics on the steps
    both log). The statistics reach the host only on the steps that log: steps 1-9 and 11 of the
    second run have none."""
    [layout] = [lay for lay in convergence.step_layouts(15, 4) if lay.name == "ep2_dp2"]
    common = [*COMMON, "--expert_bias_rate", "0.01", "--max_steps", "12", "--eval_every", "0"]
    runs = {}
    for every in ("1", "10"):
        flags = [*common, "--log_every", every]
        runs[every] = convergence.run(layout, flags, tmp_path / every, env=ENV)
    keys = ("step", "loss", "grad_norm")
    assert [[r[k] for k in keys] for r in runs["1"]] == [[r[k] for k in keys] for r in runs["10"]]
    logged = [r["step"] for r in runs["10"] if "expert_load" in r]
    assert logged == [10, 12], logged
    for step in logged:
        every, tenth = runs["1"][step - 1], runs["10"][step - 1]
        assert [every["expert_load"], every["router_loss"]] == [
            tenth["expert_load"],
            tenth["router_loss"],
        ]
    assert runs["1"][-1]["expert_load"] != runs["1"][0]["expert_load"]


def test_bf16_at_ep2_trains_like_one_process_in_bf16(tmp_path):
    """Under bf16 autocast the experts compute in bf16: ep 2 over dp 2 against one process, both
    in bf16, every loss within 1e-4 and gradient norm within 1e-3 (measured: 1.3e-5 and 2.2e-4;
    the experts' gradients scaled by the wrong ranks move the norm by 2 % in fp32)."""
    common = [*COMMON, *MOE, "--dtype", "bfloat16", "--max_steps", "3", "--eval_every", "0"]
    runs = {}
    for name, flags, nproc in [
        ("one", ["--gradient_accumulation_steps", "4"], 1),
        ("ep2", ["--dp_size", "2", "--ep_size", "2", "--gradient_accumulation_steps", "2"], 2),
    ]:
        log = tmp_path / f"{name}.jsonl"
        check(run_step(S15, [*common, *flags, "--log_file", str(log)], nproc=nproc))
        runs[name] = read_log(log)
    assert len(runs["one"]) == len(runs["ep2"]) == 3
    for got, want in zip(runs["ep2"], runs["one"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)


### Refused before the first step
@pytest.mark.parametrize(
    "flags, nproc, message",
    [
        (["--dp_size", "2", "--ep_size", "4"], 2, "--ep_size 4 borrows its ranks from dp"),
        ([*MOE, "--dp_size", "3", "--ep_size", "3"], 3, "--ep_size 3 does not divide"),
        (["--dp_size", "2", "--ep_size", "2"], 2, "--ep_size 2 apply to a mixture-of-experts"),
        (["--z_loss_coef", "0.001"], 1, "--z_loss_coef apply to a mixture-of-experts model"),
        (["--ep_size", "0"], 1, "--ep_size must be at least 1"),
        ([*MOE, "--expert_bias_rate", "-1"], 1, "--expert_bias_rate must be 0 or more, got -1.0"),
        (["--expert_bias_rate", "0.01"], 1, "--expert_bias_rate apply to a mixture-of-experts"),
        (["--moe_router", "llama4"], 1, "--moe_router llama4 apply to a mixture-of-experts"),
    ],
)
def test_what_cannot_work_is_refused(flags, nproc, message, capsys, monkeypatch):
    assert_refused(S15, [*TINY, *flags, "--max_steps", "1"], nproc, message, capsys, monkeypatch)


def test_a_checkpoint_with_other_experts_is_refused_before_the_first_step(tmp_path):
    """Saved with 4 experts per layer, resumed with 8: one line naming what differs."""
    save = tmp_path / "run"
    args = [*TINY, *MOE, "--max_steps", "1", "--save_every", "1", "--sample_tokens", "0"]
    check(run_step(S15, [*args, "--save_dir", str(save)]))
    config = json.loads((ROOT / "assets/configs/tiny-moe/config.json").read_text())
    config["num_local_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags = [*TINY, "--model_name", str(tmp_path), "--max_steps", "2", "--save_dir", str(save)]
    result = run_step(S15, [*flags, "--resume"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds another model than this one" in result.stderr, result.stderr[-2000:]
    assert "(8 experts of 2 per token, 2 layers" in result.stderr, result.stderr[-2000:]
    assert "gate.weight [4, 64] instead of [8, 64]" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "top_k, message", [(1, "the predictions' loss sends the router no gradient"), (5, "too many")]
)
def test_a_config_with_another_top_k_is_refused(tmp_path, top_k, message):
    config = json.loads((ROOT / "assets/configs/tiny-moe/config.json").read_text())
    config["num_experts_per_tok"] = top_k
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_step(S15, [*TINY, "--model_name", str(tmp_path), "--max_steps", "1"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
