"""The tools behind the foundation lessons are right: tools/collectives.py's rings give
torch.distributed's results and send the bytes of the ring formulas; tools/grid.py's groups are
those of the ProcessGroupManager of steps 2 and 11; tools/memory_table.py's measured bytes follow
its formulas, and each other."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import LAUNCH, ROOT, TINY, import_step

sys.path.insert(0, str(ROOT / "tools"))
import collectives  # noqa: E402
import grid as grid_tool  # noqa: E402
import step_times  # noqa: E402


### begin Collectives
def demo(nproc, numel, torchrun):
    """tools/collectives.py under torchrun's environment, or as plain python starting its ranks."""
    script, size = str(ROOT / "tools" / "collectives.py"), ["--numel", str(numel)]
    launcher = [f"--nproc_per_node={nproc}", script] if torchrun else ["--python", script]
    command = [*LAUNCH, *launcher, *size] + ([] if torchrun else ["--nproc", str(nproc)])
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("nproc, numel, torchrun", [(4, 8, True), (3, 6, False), (2, 4096, False)])
def test_collectives_demo(nproc, numel, torchrun):
    """The demo checks each ring's result against torch.distributed's (and fails otherwise);
    here, every tensor it prints follows the collective's definition, and every rank's bytes
    sent follow the ring formula."""
    result = demo(nproc, numel, torchrun)
    assert result.returncode == 0, result.stdout + result.stderr
    out, n, N = result.stdout, nproc, 8 * numel  # int64
    x = [torch.arange(1, numel + 1) * 10**r for r in range(n)]
    total = sum(x)
    chunks = total.chunk(n)
    want = {
        "all-reduce": [(x[r], total) for r in range(n)],
        "reduce-scatter": [(x[r], chunks[r]) for r in range(n)],
        "all-gather": [(chunks[r], total) for r in range(n)],
        "broadcast": [(x[r], x[0]) for r in range(n)],
        "send/recv": [(x[r], x[(r - 1) % n]) for r in range(n)],
    }
    shown = re.findall(r"^  rank (\d+): \[([\d ]*)\] -> \[([\d ]*)\]$", out, re.MULTILINE)
    if numel <= collectives.SHOWN:
        assert len(shown) == 5 * n, out
        for i, (rank, before, after) in enumerate(shown):
            name, r = collectives.ORDER[i // n], i % n
            assert int(rank) == r, out
            got = [[int(v) for v in t.split()] for t in (before, after)]
            assert got == [t.tolist() for t in want[name][r]], (name, r)
    else:
        assert not shown
    assert "all-reduce = reduce-scatter then all-gather: equal on every rank" in out
    # The ring all-reduce step by step: at reduce-scatter step k rank r has added chunk
    # r - k - 1 of ranks r - k .. r; at all-gather step k it receives chunk r - k, whole.
    steps = re.findall(r"^  (RS|AG) (\d+) +(.*)$", out, re.MULTILINE)
    assert len(steps) == (2 * (n - 1) if numel <= collectives.SHOWN else 0), out
    m = numel // n
    for phase, k, cells in steps:
        k = int(k)
        for r, (chunk, value) in enumerate(re.findall(r"c(\d+): (\d+)", cells)):
            c = (r - k - 1) % n if phase == "RS" else (r - k) % n
            ranks = [(r - j) % n for j in range(k + 1)] if phase == "RS" else range(n)
            assert (int(chunk), int(value)) == (c, (c * m + 1) * sum(10**j for j in ranks))
    sent = {}
    for row in re.findall(r"^\| ([a-z/ +-]+) \| ([\d |]+) \|", out, re.MULTILINE):
        sent[row[0]] = [int(v) for v in row[1].split("|")[:n]]
    assert sent["all-reduce"] == [2 * (n - 1) * N // n] * n
    assert sent["reduce-scatter"] == sent["all-gather"] == [(n - 1) * N // n] * n
    assert sent["broadcast"] == [N] * (n - 1) + [0]  # along the chain, the last passes nothing
    assert sent["send/recv"] == [N] * n
    assert sent["reduce-scatter + all-gather"] == sent["all-reduce"]


def test_the_collectives_lesson_shows_the_demos_output():
    """docs/collectives.md pastes the output of its command: the same, to the character."""
    lesson = (ROOT / "docs" / "collectives.md").read_text()
    pasted = lesson.split("## The demo's output", 1)[1].split("```\n", 2)[1]
    result = demo(4, 8, torchrun=True)
    assert result.returncode == 0, result.stderr
    assert pasted == result.stdout


def test_zero_steps_shows_each_phase_of_step_10_and_its_lesson_pastes_it():
    """tools/zero_steps.py: after the reduce-scatter each rank's own shard is the mean of the
    ranks' gradients, clipped by the whole norm; after the update only its own shard moved;
    after the all-gather every rank holds the same weight. Step 10's lesson pastes the output."""
    script = str(ROOT / "tools" / "zero_steps.py")
    result = subprocess.run(
        [*LAUNCH, "--nproc_per_node=4", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    phases, n = result.stdout.split("\n")[:-1], 4
    rows = {}  # phase: each rank's numbers
    for i in range(5):
        lines = phases[i * (n + 1) + 1 : (i + 1) * (n + 1)]
        rows[i + 1] = [
            torch.tensor([float(v) for v in line.split(":")[1].replace("|", " ").replace("[", " ")
                          .replace("]", " ").split()])
            for line in lines
        ]  # fmt: skip
    grads = torch.stack(rows[1])  # (n, 8)
    mean, shard = grads.mean(0), 8 // n
    for r in range(n):
        own = slice(r * shard, (r + 1) * shard)
        torch.testing.assert_close(rows[2][r][own], mean[own], atol=1e-3, rtol=0)
        clip = min(1.0, 10.0 / mean.norm().item())
        torch.testing.assert_close(rows[3][r][own], mean[own] * clip, atol=1e-3, rtol=0)
        moved = rows[4][r] != torch.arange(8.0)
        assert moved[own].all() and not moved.sum() > shard, rows[4][r]
        assert torch.equal(rows[5][r], rows[5][0])
        torch.testing.assert_close(rows[5][r][own], rows[4][r][own])
    lesson = (ROOT / "step10_zero1" / "README.md").read_text()
    pasted = lesson.split("tools/zero_steps.py\n```\n\n```\n", 1)[1].split("```\n", 1)[0]
    assert pasted == result.stdout


def test_collectives_demo_refuses_a_tensor_it_cannot_scatter():
    result = demo(4, 6, torchrun=False)
    assert result.returncode == 2
    assert "--numel 6 must be a positive multiple of the 4 ranks" in result.stderr


### end Collectives
### begin Grid
class FakeDist:
    """torch.distributed for one rank of `world`, without processes: new_group returns its
    ranks, so the groups a ProcessGroupManager keeps are the lists it built them from."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world

    def new_group(self, ranks, **options):
        return list(ranks)


def manager(step, rank, sizes):
    """Step `step`'s ProcessGroupManager of `rank`, built by its own code with FakeDist."""
    module = import_step(step, "process_group_manager")
    module.dist = FakeDist(rank, sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"])
    kwargs = {f"{axis}_size": sizes[axis] for axis in ["tp", "pp", "dp"]}
    if step.startswith("step11"):
        kwargs["cp_size"] = sizes["cp"]
    return module.ProcessGroupManager(**kwargs)


# Sizes that differ from each other: a group built along the wrong axis cannot pass for the right.
LAYOUTS = [(2, 2, 1, 2), (2, 3, 2, 2), (3, 1, 2, 4), (1, 4, 3, 2), (2, 1, 1, 1)]


@pytest.mark.parametrize("dp, pp, cp, tp", LAYOUTS)
def test_the_grid_picture_has_the_managers_groups(dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    grid, groups = grid_tool.layout(dp, pp, cp, tp)
    steps = ["step11_context_parallel"] + (["step2_process_group_manager"] if cp == 1 else [])
    for step in steps:
        axes = ["tp", "pp", "dp"] + (["cp", "dp_cp"] if step.startswith("step11") else [])
        for rank in range(grid.numel()):
            pgm = manager(step, rank, sizes)
            where = grid_tool.coordinates(grid, rank)
            assert [getattr(pgm, f"{a}_rank", 0) for a in grid_tool.AXES] == list(where.values())
            for axis in axes:
                mine = [g for g in groups[axis] if rank in g]
                assert len(mine) == 1, (step, rank, axis)
                assert getattr(pgm, f"{axis}_group_ids") == mine[0], (step, rank, axis)
                assert getattr(pgm, f"{axis}_group") == mine[0], (step, rank, axis)  # built so
        for axis in axes:  # the groups partition the world
            members = sorted(r for g in groups[axis] for r in g)
            assert members == list(range(grid.numel())), (step, axis)


@pytest.mark.parametrize("dp, pp, cp, tp, ep", [(4, 1, 2, 1, 2), (4, 2, 1, 1, 4), (6, 1, 1, 2, 3)])
def test_the_grid_picture_has_the_expert_layouts_groups(dp, pp, cp, tp, ep):
    """--ep: the expert layers' groups the picture lists are those step 15's manager makes from
    its second layout (EXPERT_AXES), rank by rank, and they partition the world."""
    grid, groups = grid_tool.layout(dp, pp, cp, tp, ep)
    module = import_step("step15_expert_parallel", "process_group_manager")
    for rank in range(grid.numel()):
        module.dist = FakeDist(rank, grid.numel())
        pgm = module.ProcessGroupManager(tp, pp, dp, cp, ep_size=ep)
        for axes in [("ep",), ("edp",), ("edp", "cp")]:
            [mine] = [g for g in groups["_".join(axes)] if rank in g]
            assert pgm.group(*axes)[1] == mine, (rank, axes)
    for axis in ["ep", "edp", "edp_cp"]:
        assert sorted(r for g in groups[axis] for r in g) == list(range(grid.numel())), axis
    text = grid_tool.describe(dp, pp, cp, tp, ep)
    assert f"experts: dp {dp} = edp {dp // ep} x ep {ep}" in text
    assert all(len(line) <= 100 for line in text.splitlines() if not line.startswith("rank")), text
    assert grid_tool.main(["--dp", "3", "--ep", "2"]) == 2


def test_the_grid_picture():
    text = grid_tool.describe(2, 2, 1, 2)
    assert "dp 0 │ 0 1 │ ──▶ │ 2 3 │" in text
    assert "dp 1 │ 4 5 │ ──▶ │ 6 7 │" in text
    assert "rank 3: dp 0/2 pp 1/2 cp 0/1 tp 1/2 | tp [2, 3] cp [3] pp [1, 3] dp [3, 7]" in text
    assert all(len(line) <= 100 and line == line.rstrip() for line in text.splitlines())
    assert grid_tool.main(["--tp", "0"]) == 2


### end Grid
### begin Memory table
def run_memory_table(*args):
    command = [*LAUNCH, "--python", str(ROOT / "tools" / "memory_table.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """The table's command on the test-size model (4 layers, for step 8's pp 4), and its mixture
    of experts for step 15: every layout."""
    path = tmp_path_factory.mktemp("memory") / "figures.json"
    tiny = dict(zip(TINY[::2], TINY[1::2], strict=True))
    tiny["--num_hidden_layers"] = "4"
    result = run_memory_table(*[a for pair in tiny.items() for a in pair], "--json", str(path))
    empty = {"rows": [], "shapes": {}, "moe_shapes": {}}
    figures = json.loads(path.read_text()) if path.exists() else empty
    return result, figures["rows"], figures["shapes"] | {"moe": figures["moe_shapes"]}


def ranks_of(records, step):
    """{global rank: its figures} of one step's layout."""
    return {f["rank"]: f for r in records if r["step"] == step for f in r["figures"]}


def test_memory_table_follows_its_formulas(memory):
    result, records, _ = memory
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted({r["step"] for r in records}) == list(range(3, 16))
    for record in records:  # the verdicts, checked again here with the stated tolerances
        for figures in record["figures"]:
            for quantity, (_, value, tolerance) in record["expected"].items():
                assert abs(figures[quantity] - value) <= tolerance, (record["step"], quantity)
    for step in [12, 13, 14, 15]:  # the new rows, every figure to the byte at this size
        for record in (r for r in records if r["step"] == step):
            for quantity, (_, value, _) in record["expected"].items():
                assert record["figures"][0][quantity] == value, (step, quantity)
    for row in ["| 10 | dp 2 x tp 2 |", "| 12 | dp 2, ZeRO-3 |", "| 13 | tp 2, sequence parallel |",
                "| 14 | pp 2, INTERLEAVED v 2, m 4 |", "| 15 | dp 2 (ep 2) |"]:  # fmt: skip
        assert row in result.stdout, row


def test_memory_figures_agree_with_each_other(memory):
    """Relations between the layouts' own measurements, whatever the formulas say."""
    _, records, shapes = memory
    L, D = shapes["L"], shapes["D"]
    norms = 4 * (2 * L * D + D)  # bytes of RMSNorm weights: whole on every tp rank
    one = ranks_of(records, 6)[0]  # step 6's code on one replica: the whole model
    tp2 = ranks_of(records, 4)[0]
    assert tp2["parameters"] == (one["parameters"] - norms) // 2 + norms
    for step in range(3, 10):
        for f in ranks_of(records, step).values():
            assert f["optimizer"] == 2 * f["parameters"] == 2 * f["gradients"], step
    # ZeRO-1 shares the moments: step 10 over dp 2, step 11 over dp x cp (cp 2)
    for f in ranks_of(records, 10).values():
        assert f["optimizer"] == pytest.approx(tp2["optimizer"] / 2, abs=16)
    for f in ranks_of(records, 11).values():
        assert f["optimizer"] == pytest.approx(one["optimizer"] / 2, abs=16)
        assert f["parameters"] == one["parameters"]
        assert f["activations"] == pytest.approx(one["activations"] / 2, rel=1e-3)  # T/cp
    # The stages hold the model between them, and their activations add up to one device's.
    for step in [7, 8]:
        stages = sorted(ranks_of(records, step).values(), key=lambda f: f["coords"]["pp"])
        assert sum(f["parameters"] for f in stages) == one["parameters"], step
        assert sum(f["activations"] for f in stages) == one["activations"], step
    # What the schedules hold: AFAB every micro-batch, 1F1B pp - pp_rank of them.
    for step, held in [(7, lambda r: 4), (8, lambda r: 4 - r), (9, lambda r: 2 - r)]:
        for f in ranks_of(records, step).values():
            assert f["held"] == held(f["coords"]["pp"]), (step, f["coords"])
            assert f["peak_activations"] == f["held"] * f["activations"], step
    for step in [3, 4, 5, 6, 10, 11]:
        for f in ranks_of(records, step).values():
            assert f["held"] == 1 and f["peak_activations"] == f["activations"], step


def moe_parameters(shapes):
    """The numbers of parameters of step 15's whole mixture of experts (its own modules, on the
    meta device), at the sizes of `shapes`: all of them, and the experts'."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "assets" / "configs" / "tiny-moe")
    names = {"D": "hidden_size", "F": "intermediate_size", "H": "num_attention_heads",
             "K": "num_key_value_heads", "L": "num_hidden_layers", "d": "head_dim"}  # fmt: skip
    for key, name in names.items():
        setattr(config, name, shapes[key])
    model = import_step("step15_expert_parallel", "model")
    moe = import_step("step15_expert_parallel", "moe")
    with torch.device("meta"):
        whole = moe.apply_moe(model.LlamaForCausalLM(config))
    named = dict(whole.named_parameters())
    experts = sum(p.numel() for name, p in named.items() if ".experts." in name)
    return sum(p.numel() for p in named.values()), experts


def test_memory_figures_of_the_later_steps_agree_with_each_other(memory):
    """Steps 12 to 15 against the earlier layouts' measurements and the models' own sizes."""
    _, records, shapes = memory
    B, T, D, L = (shapes[x] for x in "BTDL")
    one, tp2 = ranks_of(records, 6)[0], ranks_of(records, 4)[0]
    # ZeRO-3 at dp 2: half of one device's parameters, gradients and moments, to the byte; the
    # whole weights it gathers for a layer's forward are no activations.
    for f in ranks_of(records, 12).values():
        for quantity in ["parameters", "gradients", "optimizer"]:
            assert 2 * f[quantity] == one[quantity], quantity
        assert f["activations"] == f["peak_activations"] == one["activations"]
    # Sequence parallelism at tp 2: tp 2's weights; half of the norms' activations, which tp 2
    # keeps whole on each rank: 2 per layer and the final one, each its input and normalised
    # input (BTD each) and 1/rms (BT), in fp32.
    norms = 4 * ((2 * L + 1) * (2 * B * T * D + B * T))
    for f in ranks_of(records, 13).values():
        for quantity in ["parameters", "gradients", "optimizer"]:
            assert f[quantity] == tp2[quantity], quantity
        assert tp2["activations"] - f["activations"] == norms // 2
    # Interleaved, pp 2 x v 2: the ranks hold the model between them; they hold the warm-up's
    # chunks of micro-batches and one more, (v - 1) pp + 2 (pp - pp_rank - 1) + 1.
    ranks = sorted(ranks_of(records, 14).values(), key=lambda f: f["coords"]["pp"])
    for quantity in ["parameters", "activations"]:
        assert sum(f[quantity] for f in ranks) == one[quantity], quantity
    assert [f["held"] for f in ranks] == [5, 3]
    for f in ranks:  # more than one micro-batch's, less than its chunks' count of the largest
        assert f["activations"] < f["peak_activations"] < f["held"] * f["activations"]
    # Expert parallelism, ep 2 of dp 2: each rank the experts of its ep rank, E/ep of each layer,
    # everything else whole; ZeRO-1 shares the rest's moments over dp 2, the experts' over none.
    whole, experts = moe_parameters(shapes["moe"])
    ranks = ranks_of(records, 15).values()
    buckets = L + 2  # the experts' buckets cut the others' at each layer: padding in each
    for f in ranks:
        assert f["parameters"] == 4 * (whole - experts) + 4 * experts // 2
        assert f["gradients"] == pytest.approx(f["parameters"], abs=4 * buckets)
        want = 8 * (whole - experts) / 2 + 8 * experts // 2
        assert f["optimizer"] == pytest.approx(want, abs=8 * buckets)
    # Every token slot of every rank's tokens went to one expert, on one rank.
    k = shapes["moe"]["k"]
    assert sum(f["routed_rows"] for f in ranks) == len(ranks) * L * B * T * k


def test_the_memory_lesson_shows_the_formulas_values():
    """docs/memory.md's table (the tiny model at the command's defaults): every cell's bytes and
    formula are those the formulas give now, so the lesson cannot go stale."""
    import memory_table

    shapes = {}
    for moe, name in [(False, "tiny"), (True, "tiny-moe")]:
        config = json.loads((ROOT / "assets" / "configs" / name / "config.json").read_text())
        config = SimpleNamespace(**config)
        shapes[moe] = memory_table.Shapes(config, memory_table.parse_args([]))
    lesson = (ROOT / "docs" / "memory.md").read_text()
    assert "tiny model, one training step on random tokens, 4 x 256 tokens" in lesson
    rows = [line for line in lesson.splitlines() if re.match(r"\| \d+ \|", line)]
    steps = [int(row.split("|")[1]) for row in rows]
    assert sorted(set(steps)) == list(range(3, 16)), steps
    for row, step in zip(rows, steps, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        stage = re.search(r"\(pp (\d)\)", cells[2])
        pp_rank = int(stage[1]) if stage else 0
        layout = memory_table.LAYOUTS[step]
        # Step 15's activations count the rows its experts received, as the run measured them.
        routed = re.search(r"([\d,]+)ρ", cells[6]) if layout.moe else None
        routed = int(routed[1].replace(",", "")) if routed else 0
        want = memory_table.expected(layout, shapes[layout.moe], pp_rank, routed)
        for quantity, cell in zip(memory_table.QUANTITIES, cells[3:], strict=True):
            text, value, _ = want[quantity]
            assert cell == f"{value:,.0f} = {text}", (step, quantity, cell)


def test_memory_table_refuses_a_layout_the_model_cannot_take():
    result = run_memory_table("--steps", "8", "--num_hidden_layers", "2")
    assert result.returncode == 2
    assert "pp_size=4 needs at least 4 layers, the model has num_hidden_layers=2" in result.stderr


### end Memory table


def test_step_times_pools_the_logs_of_a_side(tmp_path):
    """Steps after each log's first, and after a resume's first, timed as tokens over tokens/s;
    the medians side by side, each over the first side's."""

    def log(name, steps):  # (step, tokens so far, tokens per second)
        lines = [json.dumps({"step": s, "tokens": t, "tokens_per_second": r, "loss": 1.0})
                 for s, t, r in steps]  # fmt: skip
        (tmp_path / name).write_text("\n".join([*lines, json.dumps({"val_loss": 1.0})]) + "\n")

    log("a_1.jsonl", [(1, 100, 1.0), (2, 200, 100.0), (3, 300, 50.0)])  # 1 s, 2 s
    log("a_2.jsonl", [(1, 100, 1.0), (2, 200, 25.0), (2, 200, 1.0), (3, 300, 100.0)])  # 4 s, 1 s
    log("b_1.jsonl", [(1, 100, 1.0), (2, 200, 50.0)])  # 2 s
    sides = [step_times.side(f"{x}={tmp_path}/{x}_*.jsonl") for x in "ab"]
    assert sides == [("a", 2, [1.0, 2.0, 4.0, 1.0]), ("b", 1, [2.0])]
    assert step_times.table(sides).splitlines()[2:] == [
        "| a | 2 | 4 | 1.500 | 1.000 | 4.000 | 1.00 |",
        "| b | 1 | 1 | 2.000 | 2.000 | 2.000 | 1.33 |",
    ]
    with pytest.raises(ValueError, match="no log matches"):
        step_times.side(f"c={tmp_path}/c_*.jsonl")
