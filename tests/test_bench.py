"""tools/bench.py's agreement checks, run cheaply: our model equals transformers', bucketed and
naive data parallelism equal DDP, our tensor and sequence parallelism's losses equal DTensor's,
our 1F1B and AFAB gradients equal torch.distributed.pipelining's Schedule1F1B, ZeRO-1's gradients
and updated weights equal ZeroRedundancyOptimizer's and FSDP2's, and ring attention, the
all-gather-KV baseline and PyTorch's ring function equal float64 SDPA, so the comparisons cannot
rot."""

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench  # noqa: E402

TINY_BENCH = [
    "--num_hidden_layers", "4", "--hidden_size", "64", "--intermediate_size", "128",
    "--num_attention_heads", "4", "--num_key_value_heads", "2",
    "--seq_len", "16", "--micro_batch_size", "2", "--micro_batches", "4",
    "--steps", "1", "--warmup", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def run():
    """run(part): that comparison's rows (the checked step, then one timed step per side), by our
    side's name and by (ours, theirs). Every part runs once, shared by the tests, at the first
    call: those on one process here, those on 2 ranks one after the other in one start of the
    ranks, as `python tools/bench.py` runs them."""
    cache = {}

    def rows(part):
        if not cache:
            args = bench.parse_args([*TINY_BENCH, "--parts", ",".join(bench.WORLD)])
            for world in sorted(set(bench.WORLD.values())):
                parts = [p for p in bench.WORLD if bench.WORLD[p] == world]
                for name, found in bench.run_parts(parts, args, timeout=300).items():
                    cache[name] = {r["ours"]: r for r in found}
                    cache[name] |= {(r["ours"], r["theirs"]): r for r in found}
        return cache[part]

    return rows


def checks(row):
    return {what: value for what, value, _ in row["checks"]}


def test_pipeline_gradients_equal_schedule_1f1b(run):
    """Every gradient of every stage after one step; m = 4 is a power of two, so dividing the
    loss by m (ours) and the summed gradients by m (theirs) round alike: equal to the bit."""
    for engine in ["1F1B", "AFAB"]:
        row = run("pp")[engine]
        assert row["theirs"] == "Schedule1F1B"
        assert checks(row)["grad"] <= 1e-6, row
        assert row["ok"]


def test_step14_gradients_equal_torchs_schedules(run):
    """Step 14's interleaved 1F1B, pp 2 x 2 chunks of one layer, and ZB-H1, pp 2 x 2 layers, m 4,
    against torch's schedules on the same chunks (ZB1P for ZB-H1, its backward split by autograd,
    ours by zero_bubble.py's layers): every gradient to the bit (both divide the same sums by
    m = 4)."""
    theirs = {"interleaved": "ScheduleInterleaved1F1B", "zb1": "ScheduleInterleavedZeroBubble"}
    for part, schedule in theirs.items():
        row = run(part)[part]
        assert row["theirs"] == schedule
        assert checks(row)["grad"] == 0.0, row
        assert row["ok"]


def test_tensor_parallel_loss_equals_dtensor(run):
    """The losses of two steps (the checked one and the timed one), each side training."""
    row = run("tp")[("ours", "DTensor")]
    assert checks(row)["loss"] <= 1e-5, row


def test_sequence_parallel_loss_equals_dtensor(run):
    """Step 13 against DTensor's SequenceParallel plan: the losses of the two steps."""
    row = run("sp")[("ours", "DTensor")]
    assert checks(row)["loss"] <= 1e-5, row


def test_tensor_parallel_sends_three_all_reduces_fewer_per_block(run):
    """Against the layers each with its own f (q, k, v, gate, up): one f per sublayer saves 2
    all-reduces of (B, T, D) at attention's input and 1 at the MLP's, per block and micro-batch,
    in backward, and computes the same losses."""
    row = run("tp")[("ours", "f per layer")]
    (calls, size), (calls_before, size_before) = (
        row["traffic"]["ours"],
        row["traffic"]["f per layer"],
    )
    args = bench.parse_args([*TINY_BENCH, "--parts", "tp"])
    config = bench.bench_parts.load_config(args)
    per_micro_batch = 3 * config.num_hidden_layers
    activation = args.micro_batch_size * args.seq_len * config.hidden_size * 4  # fp32 bytes
    assert calls_before - calls == per_micro_batch * args.micro_batches, row["traffic"]
    assert size_before - size == per_micro_batch * args.micro_batches * activation
    assert checks(row)["loss"] <= 1e-5, row


def test_model_and_data_parallel_agree(run):
    model = run("model")["ours"]
    assert model["theirs"] == "transformers"
    assert checks(model)["grad"] <= 1e-5 and checks(model)["loss"] <= 1e-5, model
    for name in ["bucketed", "naive"]:
        row = run("dp")[name]
        assert row["theirs"] == "DDP"
        assert checks(row)["grad"] <= 1e-6, row


def test_zero1_equals_zero_redundancy_optimizer_and_fsdp2(run):
    """Our shard of each averaged gradient against DDP's whole gradient, and the weights after
    the update, one step (0 on this machine: with 2 ranks every side rounds alike)."""
    for theirs in ["ZeroRedundancyOptimizer", "FSDP2"]:
        row = run("zero")[("ours", theirs)]
        assert checks(row)["grad"] <= 1e-6 and checks(row)["param"] <= 1e-6, row
        assert row["ok"]
    row = run("zero")[("ours", "FSDP2")]
    assert checks(row)["grad FSDP2"] <= 1e-6 and checks(row)["param FSDP2"] <= 1e-6, row


def test_ring_attention_rows_agree_with_float64_sdpa(run):
    """The output and the q, k, v gradients of ring attention, the all-gather-KV baseline and
    PyTorch's ring function, against float64 SDPA on the whole sequence."""
    for theirs in ["_templated_ring_attention", "all-gather KV"]:
        row = run("cp")[("ours", theirs)]
        assert checks(row)[" ours"] <= 1e-5 and checks(row)[" theirs"] <= 1e-5, row
        assert row["ok"]


def test_expert_exchange_agrees_with_torchs_all_to_all_and_one_rank(run):
    """Step 15's exchange and the same through PyTorch's all_to_all_single_autograd: the input's
    and every parameter's gradient those of one rank with every expert."""
    row = run("ep")[("ours", "all_to_all_single_autograd")]
    assert checks(row)[" ours"] <= 1e-5 and checks(row)[" all_to_all_single_autograd"] <= 1e-5
    assert row["ok"]


def test_zero3_equals_fsdp2(run):
    """Step 12's ZeRO-3 and FSDP2 resharded after forward: every rank's rows of every averaged
    gradient, then of every parameter after the update, and every loss, to the bit."""
    row = run("zero3")[("ours", "FSDP2")]
    assert checks(row)[" grad"] == 0.0 and checks(row)[" param"] == 0.0, row
    assert checks(row)[" loss"] == 0.0 and row["ok"]


def test_kv_cache_generates_the_recomputed_and_transformers_tokens(run):
    """Step 3's KV cache: the same greedy tokens as recomputing the prefix and as transformers'
    generate with its cache."""
    for theirs in ("recompute", "transformers"):
        row = run("kv_cache")[("cached", theirs)]
        assert checks(row)["tokens"] == 0.0 and row["ok"], row


def test_table_shows_every_comparison(run):
    parts = ["model", "kv_cache", "dp", "tp", "pp", "zero", "cp", "sp", "interleaved", "zb1"]
    parts += ["ep", "zero3"]
    assert sorted(parts) == sorted(bench.WORLD)
    rows = [row for part in parts for key, row in run(part).items() if isinstance(key, tuple)]
    text = bench.table(rows)
    assert text.count("\n") == len(rows) + 1  # a header, a rule, one line per comparison
    for row in rows:
        assert row["ours_ms"] > 0 and row["theirs_ms"] > 0, row
    assert "FAILED" not in text


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as error:
        bench.parse_args(["--parts", "model,moe"])
    assert error.value.code == 2
    assert "unknown moe" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        bench.parse_args(["--parts", "sp", "--seq_len", "15"])
    assert error.value.code == 2
    assert "--seq_len must be a multiple of tp = 2 for sp" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        bench.parse_args(["--parts", "cp", "--seq_len", "30"])
    assert error.value.code == 2
    assert "--seq_len must be a multiple of 2 * cp = 4 for cp" in capsys.readouterr().err
