"""What a training step waits for, counted in every step from 3 to 15 at its technique's smallest
layout: its collectives, by the size of their group, and its host syncs. On a GPU every read of a
device value on the host waits for the queue to drain, and every collective is a launch and a
wait; a collective on a group of one rank sends nothing and still costs both.

Outside its technique a step makes one collective and one host sync: the step's facts (the loss,
whether it and the gradient norm are finite on every rank, whether SIGTERM came, and a technique's
own sums) travel in one all-reduce over the world, skipped in a world of one, and are read in one
`.tolist()` (`bookkeeping.agree`). Each test below names what its technique adds, and why.

A launcher wraps every torch.distributed call and every read of a tensor on the host (`item`,
`tolist`, `bool`, `int`, `float`, `index`, `cpu`, `numpy`) before train.main() runs, and writes
each rank's counts for the run's second step: not the first, which also creates the optimizer
state, nor the last, which validates and logs (with --log_every 10 the second step prints
nothing: what reaches the host only to be printed is read on log steps). The data loader's
`.item()` reads a row index from its shuffled order, a CPU tensor: not a wait on the device, and
not counted. L layers, M micro-batches a step (RUN).
"""

import json

from conftest import TINY, check, run_step, step_dir

L, M = 2, 2  # TINY's layers; RUN's micro-batches
RUN = [*TINY, "--num_proc", "1", "--max_steps", "3", "--gradient_accumulation_steps", str(M)]
RUN += ["--sample_tokens", "0", "--eval_steps", "1", "--eval_every", "0", "--log_every", "10"]
FACTS = {"all_reduce on world": 1, "host sync": 1}  # bookkeeping.agree, every step

COUNTER = """import collections
import json
import os
import sys
from pathlib import Path

step = Path(sys.argv[1]).resolve()
out = Path(sys.argv[2])
sys.path.insert(0, str(step))  # the step's modules
sys.argv = [str(step / "train.py"), *sys.argv[3:]]
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # the originals, never wrapped
import bookkeeping
import train
import utils

phase = [0]
counts, sites = collections.Counter(), collections.defaultdict(collections.Counter)
CALLS = [
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier",
]
READS = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"]


def site():
    # The line of the step's code that made the call (file:line), for the failure's message.
    frame = sys._getframe(2)
    while frame and not frame.f_code.co_filename.startswith(str(step)):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}" if frame else "?"


def note(what, where):
    if phase[0] == 2:
        counts[what] += 1
        sites[what][where] += 1


def counted(name, original):
    def call(*args, **kwargs):
        group = kwargs.get("group")
        group = group or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        if name == "batch_isend_irecv":
            group = args[0][0].group
        size = dist.get_world_size(group)
        world = group in (None, dist.group.WORLD) and size > 1
        note(f"{name} on {'world' if world else f'group of {size}'}", site())
        return original(*args, **kwargs)

    call.__name__ = name
    return call


for name in CALLS:
    if hasattr(dist, name):
        setattr(dist, name, counted(name, getattr(dist, name)))


class P2POp(dist.P2POp):
    # torch's P2POp takes only its own isend and irecv: given a wrapper, it gets the original.
    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, getattr(c10d, op.__name__), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(getattr(c10d, op.__name__), *args, **kwargs)


dist.P2POp = P2POp


def host(name, original):
    def read(self, *args, **kwargs):
        where = site()
        if not where.startswith("dataloader.py"):
            note("host sync", f"{where} {name}")
        return original(self, *args, **kwargs)

    return read


for name in READS:
    setattr(torch.Tensor, name, host(name, getattr(torch.Tensor, name)))
begin = bookkeeping.Run.begin


def begin_step(self, step, *args):
    phase[0] = step
    return begin(self, step, *args)


bookkeeping.Run.begin = begin_step
try:
    utils.run_main(train.main)
finally:
    second = {"counts": counts, "sites": sites}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(second))
"""


def count(tmp_path, step, args, nproc):
    """Each rank's calls in the second step, {"counts": {"all_reduce on world": 1, "host sync":
    1, ...}, "sites": {the same keys: {"bookkeeping.py:160": 1, ...}}}."""
    launcher, out = tmp_path / "count.py", tmp_path / "counts"
    launcher.write_text(COUNTER)
    out.mkdir()
    run = run_step(step, [str(step_dir(step)), str(out), *RUN, *args], nproc, script=launcher)
    check(run)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def assert_counts(tmp_path, step, args, expected):
    """`expected`: each rank's counts, in rank order."""
    ranks = count(tmp_path, step, args, len(expected))
    for rank, (seen, wanted) in enumerate(zip(ranks, expected, strict=True)):
        ones = {what: seen["sites"][what] for what in seen["counts"] if "group of 1" in what}
        assert not ones, f"rank {rank}: collectives on a group of one rank: {ones}"
        assert seen["counts"] == wanted, f"rank {rank}, made at: {seen['sites']}"


def test_step3_one_process(tmp_path):
    """One process: a world of one, every group of one rank. No collective (agree skips its
    all-reduce), and the facts' one host sync."""
    assert_counts(tmp_path, "step3_dataloader", [], [{"host sync": 1}])


def test_step4_tensor_parallel(tmp_path):
    """tp 2: M (4 L + 5) + 1 all-reduces on the tp group. In each micro-batch's forward, g's sum
    of the partial results after the embedding and after each layer's o_proj and down_proj
    (1 + 2 L) and the loss's three over the vocabulary shards (the max, the sum of exponentials,
    the target's logit); in its backward, f's sum of the input gradient where each norm's output
    enters the column-parallel layers (q/k/v, gate/up, lm_head: 2 L + 1). Then the gradient
    norm's sum of squares over tp, once a step; and the facts."""
    tp = {"all_reduce on group of 2": M * (4 * L + 5) + 1}
    assert_counts(tmp_path, "step4_tensor_parallel", ["--tp_size", "2"], [{**FACTS, **tp}] * 2)


def test_step5_naive_data_parallel(tmp_path):
    """dp 2, naive: one all-reduce per parameter (each layer's 7 matrices and 2 norms, the
    embedding, the final norm, lm_head: 9 L + 3), in the last micro-batch's backward only; the
    gradient norm needs none (after the all-reduces every dp rank holds the same gradients); and
    the facts."""
    dp = {"all_reduce on group of 2": 9 * L + 3}
    args = ["--dp_size", "2"]
    assert_counts(tmp_path, "step5_data_parallel_naive", args, [{**FACTS, **dp}] * 2)


def test_step6_bucketed_data_parallel(tmp_path):
    """dp 2, one 25 MiB bucket (the whole tiny model): one all-reduce on the dp group, launched
    in the last micro-batch's backward; and the facts."""
    dp = {"all_reduce on group of 2": 1}
    args = ["--dp_size", "2"]
    assert_counts(tmp_path, "step6_data_parallel_bucket", args, [{**FACTS, **dp}] * 2)


def pipeline(sends, receives):
    """pp 2 (M >= pp: each micro-batch crosses once each way): stage 0 sends each micro-batch's
    activations and receives its input gradient, stage 1 the other way round; one all-reduce
    over the stages sums the squares of the gradient norm; and the facts."""
    stage0 = {**FACTS, f"isend on {sends}": M, f"irecv on {receives}": M}
    stage1 = {**FACTS, f"irecv on {sends}": M, f"isend on {receives}": M}
    return [{**stage, "all_reduce on group of 2": 1} for stage in (stage0, stage1)]


def test_step7_all_forward_all_backward(tmp_path):
    """pp 2, AFAB: `pipeline`, both ways on the default group (the world, at pp 2)."""
    args = ["--pp_size", "2", "--pp_engine", "afab"]
    assert_counts(tmp_path, "step7_pipeline_parallel_afab", args, pipeline("world", "world"))


def test_step8_one_forward_one_backward(tmp_path):
    """pp 2, 1F1B: the same messages as AFAB, in another order (`pipeline`)."""
    args = ["--pp_size", "2", "--pp_engine", "1f1b"]
    assert_counts(tmp_path, "step8_pipeline_parallel_1f1b", args, pipeline("world", "world"))


def test_step9_3d_parallel(tmp_path):
    """tp 2 x pp 2, 1F1B, L / 2 layers a stage: the tp all-reduces of step 4 for each stage's
    part of the model, four a layer (two g forward, two f backward): stage 0 (ranks 0, 1) its
    layers' and the embedding's g, M (2 L + 1); stage 1 (ranks 2, 3) its layers', the loss's
    three and lm_head's f, M (2 L + 4). The pipeline's messages of step 8, one a micro-batch each
    way; the gradient norm's sum over tp x pp (a group of 4); no dp collective; the facts."""
    both = {**FACTS, "isend on world": M, "irecv on world": M, "all_reduce on group of 4": 1}
    stage0, stage1 = ({**both, "all_reduce on group of 2": M * n} for n in (2 * L + 1, 2 * L + 4))
    args = ["--tp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"]
    assert_counts(tmp_path, "step9_3d_parallel", args, [stage0, stage0, stage1, stage1])


def test_step10_zero1(tmp_path):
    """ZeRO-1 at dp 2, one bucket: its reduce-scatter in the last micro-batch's backward (each
    rank keeps the mean of its shard), the gradient norm's sum of the shards' squares over dp,
    one all-gather of the updated shards, and the facts."""
    zero = {
        "reduce_scatter_single on group of 2": 1,
        "all_reduce on group of 2": 1,
        "all_gather_single on group of 2": 1,
    }
    assert_counts(tmp_path, "step10_zero1", ["--dp_size", "2"], [{**FACTS, **zero}] * 2)


def test_step11_context_parallel(tmp_path):
    """cp 2: ring attention's exchanges, each one batch of sends and receives with the ring's
    neighbours: per layer and micro-batch, cp - 1 hops of the keys and values forward, and in
    backward cp - 1 hops of them again and cp hops of their gradient (which comes home last):
    M L (3 cp - 2). ZeRO-1 over dp x cp, the ranks with the same weights (step 10's three), and
    the facts."""
    cp = {
        "batch_isend_irecv on group of 2": M * L * (3 * 2 - 2),
        "reduce_scatter_single on group of 2": 1,
        "all_reduce on group of 2": 1,
        "all_gather_single on group of 2": 1,
    }
    args = ["--cp_size", "2"]
    assert_counts(tmp_path, "step11_context_parallel", args, [{**FACTS, **cp}] * 2)


def test_step12_zero2(tmp_path):
    """ZeRO-2 at dp 2, one bucket: no whole gradient is kept between micro-batches, so the
    bucket is reduce-scattered in every micro-batch's backward (M); then step 10's gradient norm
    and all-gather, and the facts."""
    zero = {
        "reduce_scatter_single on group of 2": M,
        "all_reduce on group of 2": 1,
        "all_gather_single on group of 2": 1,
    }
    args = ["--dp_size", "2", "--zero_stage", "2"]
    assert_counts(tmp_path, "step12_zero3", args, [{**FACTS, **zero}] * 2)


def test_step12_zero3(tmp_path):
    """ZeRO-3 at dp 2, freed after each forward: L + 3 units (the embedding, each layer, the
    final norm, lm_head), each gathered before its forward and again before its backward, and
    its gradient reduce-scattered once backward has made it, in every micro-batch; the gradient
    norm's sum over dp; nothing gathered after the step (the next forward gathers); the facts."""
    zero = {
        "all_gather_single on group of 2": 2 * (L + 3) * M,
        "reduce_scatter_single on group of 2": (L + 3) * M,
        "all_reduce on group of 2": 1,
    }
    args = ["--dp_size", "2", "--zero_stage", "3"]
    assert_counts(tmp_path, "step12_zero3", args, [{**FACTS, **zero}] * 2)


def test_step13_sequence_parallel(tmp_path):
    """tp 2 with sequence parallelism: step 4's all-reduces of the activations cut in two along
    the sequence. g (the embedding, o_proj, down_proj: 1 + 2 L) reduce-scatters forward and
    all-gathers backward; f (each norm's output into the column-parallel layers: 2 L + 1)
    all-gathers forward and reduce-scatters backward: M (4 L + 2) of each. All-reduces: each
    norm's weight gradient summed over tp in each backward (2 L + 1, the norm saw only this
    rank's tokens), the loss's three, and once a step the gradient norm's: M (2 L + 4) + 1. And
    the facts."""
    sp = {
        "all_gather_single on group of 2": M * (4 * L + 2),
        "reduce_scatter_single on group of 2": M * (4 * L + 2),
        "all_reduce on group of 2": M * (2 * L + 4) + 1,
    }
    args = ["--tp_size", "2", "--sequence_parallel"]
    assert_counts(tmp_path, "step13_sequence_parallel", args, [{**FACTS, **sp}] * 2)


def test_step14_zero_bubble(tmp_path):
    """pp 2, ZB-H1: the pipeline's messages of step 8 (B sends the input gradient; W, the
    weights' gradient, sends nothing), the activations on the default group and the gradients
    on the pipeline's own gradient group (`gradient_group`, a group of 2 at pp 2); the gradient
    norm's sum over the stages; and the facts."""
    args = ["--pp_size", "2", "--pp_engine", "zb1"]
    assert_counts(tmp_path, "step14_pipeline_schedules", args, pipeline("world", "group of 2"))


MOE = ["--model_name", "tiny-moe"]  # every layer's MLP a mixture of experts


def test_step15_experts_on_one_process(tmp_path):
    """ep 1, one process: no collective (every group of one), the facts' host sync with the
    router's statistics riding on it (read on the host only on a step that logs), and one read
    of the split sizes per MoE layer and micro-batch: `exchange_locally` gives `run_experts` the
    rows of each expert as a list (`rows.split`, uneven), as `all_to_all_single` needs them at
    ep 2. 1 + L M."""
    assert_counts(tmp_path, "step15_expert_parallel", MOE, [{"host sync": 1 + L * M}])


def test_step15_expert_parallel(tmp_path):
    """ep 2 over dp 2, every MoE layer's four experts two a rank. `expert_parallel.exchange`, per
    MoE layer and micro-batch: forward, the all-to-all of the split sizes (each rank's rows for each
    expert), then the rows' dispatch and combine; backward, the two all-to-alls of their gradients
    the other way (`AllToAll`), with the sizes forward kept: 5 L M all-to-alls. The split sizes
    reach the host in forward, in one read (the rows sent to each rank, those received from each,
    those received for each local expert, in one `.tolist()`): L M host syncs, as at ep 1. ZeRO-1
    over dp: the dense parameters' buckets, cut at each layer's experts (L + 1), each reduce-
    scattered and all-gathered on the dp group; the experts' buckets are averaged over edp x cp, a
    group of one here: no call. The gradient norm's sum over dp (ep's experts are among its pieces).
    The facts, with the router's statistics on their all-reduce (none of their own). No collective
    on a group of one."""
    ep = {
        "all_to_all_single on group of 2": 5 * L * M,
        "reduce_scatter_single on group of 2": L + 1,
        "all_gather_single on group of 2": L + 1,
        "all_reduce on group of 2": 1,
        "all_reduce on world": 1,
        "host sync": 1 + L * M,
    }
    args = [*MOE, "--dp_size", "2", "--ep_size", "2"]
    assert_counts(tmp_path, "step15_expert_parallel", args, [ep] * 2)
