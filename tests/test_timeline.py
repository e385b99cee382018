"""The pictures and measures of a run: FLOP/s and MFU on the step line, --profile's traces, the
pipeline Timeline's Chrome trace and tools/plot_timeline.py that draws it."""

import json
import subprocess
import sys
import time
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, TINY, check, import_step, run_step

ONE_F_ONE_B = "step8_pipeline_parallel_1f1b"


def test_throughput_gives_flops_and_mfu_when_the_peak_is_known():
    utils = import_step("step1_model", "utils")
    assert utils.throughput(90.04e9, None) == "90.0 GFLOP/s"
    assert utils.throughput(400e12, 989e12) == "400.0 TFLOP/s | mfu 40.4%"


def test_profile_writes_one_trace_per_rank(tmp_path):
    args = [*TINY, "--max_steps", "3", "--num_proc", "1", "--sample_tokens", "2"]
    args += ["--dp_size", "2", "--eval_steps", "1", "--profile", str(tmp_path / "profile")]
    result = check(run_step("step3_dataloader", args, nproc=2))
    assert "GFLOP/s" in result.stdout
    traces = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert [path.name.split(".")[0] for path in traces] == ["rank0", "rank1"]
    for path in traces:
        events = json.loads(path.read_text())["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events)  # the model's matmuls
    # With every allocation in it: tools/trace_memory.py prints each rank's most held at once.
    tool = [sys.executable, str(ROOT / "tools" / "trace_memory.py")]
    shown = subprocess.run([*tool, str(tmp_path / "profile")], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    for path, line in zip(traces, shown.stdout.splitlines(), strict=True):
        events = json.loads(path.read_text())["traceEvents"]
        sizes = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
        assert max(sizes) > 0 and line.endswith(f"bytes: cpu {max(sizes):,}"), line
    empty = subprocess.run([*tool, str(tmp_path)], capture_output=True, text=True)
    assert empty.returncode == 2 and "no trace" in empty.stderr, empty.stderr


def test_trace_overlap_counts_the_all_gathers_time_beside_the_training_threads_operators(tmp_path):
    """A trace as the profiler writes it: the training thread (the one with the matmuls) runs two
    ATen operators, 0-10 and 20-30 ms, inside an autograd span, and calls c10d at 12-13 ms; neither
    of those counts (a thread that waits in a hook is inside an autograd span too). gloo's thread
    all-gathers from 5 to 25 ms: 10 of its 20 ms hidden."""
    span = lambda name, tid, ms, dur, cat="cpu_op": {  # noqa: E731
        "ph": "X",
        "name": name,
        "tid": tid,
        "ts": 1000 * ms,
        "dur": 1000 * dur,
        "cat": cat,
    }
    events = [
        span("autograd::engine::evaluate_function: MmBackward0", 1, 0, 40),
        span("aten::mm", 1, 0, 10), span("aten::addmm", 1, 20, 10),
        span("c10d::_allgather_base_", 1, 12, 1),
        span("gloo:all_gather", 2, 5, 20, "user_annotation"),
    ]  # fmt: skip
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / "rank0.1.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    tool = [sys.executable, str(ROOT / "tools" / "trace_overlap.py"), str(folder)]
    result = subprocess.run(tool, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(
        "1 all-gathers, 20.0 ms, 10.0 ms of it while the training thread computed (50 %)\n"
    ), result.stdout


def test_profile_refuses_a_run_too_short_to_record():
    args = [*TINY, "--max_steps", "2", "--profile", "p"]
    result = run_step("step3_dataloader", args, torchrun=False)
    assert result.returncode == 2
    assert "--profile records steps 3 to 5; --max_steps 2 stops before" in result.stderr


def schedule_trace(tmp_path):
    """A trace written as Timeline.report writes it, from two Timelines run in this process: stage
    0 runs F1 F2 B1 B2, stage 1 F1 B1 F2 B2; before every forward or backward, a pause of 2 ms,
    spent blocked on a receive before the forwards and on nothing (the loop) before the
    backwards, and after each backward 2 ms blocked on a send."""
    pp = import_step(ONE_F_ONE_B, "pipeline_parallel")
    recorder = import_step(ONE_F_ONE_B, "pipeline_timeline")
    stages = []
    for order in (["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]):
        schedule = recorder.Timeline()
        for item in order:
            with schedule.blocked("receive", active=item[0] == "F"):
                time.sleep(0.002)
            with schedule.run(pp.Action(item[0], int(item[1]))):
                time.sleep(0.003)
            with schedule.blocked("send", active=item[0] == "B"):
                if item[0] == "B":
                    time.sleep(0.002)
        assert schedule.peak_in_flight == (2 if order[1] == "F1" else 1)
        stages.append(schedule.trace_events(len(stages), time.time_ns()))
    path = tmp_path / "trace.json"
    recorder.write_trace(path, stages, {"engine": "test", "pp_size": 2, "micro_batches": 2})
    return path


def test_schedule_trace_has_every_span_and_the_waits_between(tmp_path):
    trace = json.loads(schedule_trace(tmp_path).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0
    for stage, expected in enumerate([["F1", "F2", "B1", "B2"], ["F1", "B1", "F2", "B2"]]):
        row = sorted((e for e in spans if e["tid"] == stage), key=lambda e: e["ts"])
        for before, after in pairwise(row):
            assert before["ts"] + before["dur"] == after["ts"]  # the spans tile the step
        compute = [e for e in row if e["cat"] in ("forward", "backward")]
        assert [e["name"] for e in compute] == expected
        assert all(2900 <= e["dur"] for e in compute)  # microseconds
        # What came between each forward or backward and the one before it: a receive before a
        # forward; before a backward no receive, only the loop's own 2 ms ("other"). (Spans that
        # follow each other in the code are apart by whatever the clock moved between them,
        # which on a loaded machine can be more than a receive's length, so no order is asked.)
        ends = [0] + [row.index(e) + 1 for e in compute]
        for e, start in zip(compute, ends, strict=False):
            between = row[start : row.index(e)]
            if e["cat"] == "forward":
                assert "receive" in [s["cat"] for s in between]
            else:
                assert "receive" not in [s["cat"] for s in between]
                assert sum(s["dur"] for s in between if s["cat"] == "other") >= 1900
        sends = [e for e in row if e["cat"] == "send"]
        assert len(sends) == 2 and all(1900 <= e["dur"] for e in sends)
        assert all(1900 <= e["dur"] for e in row if e["cat"] == "receive")


def overlap_trace(tmp_path):
    """A dp trace written the way train.py writes it, from an OverlapTimeline fed by hand: a
    backward of 33 ms whose two buckets are launched at 2 and 25 ms and take 20 ms each, the first
    done 11 ms before backward ends, the second 12 ms after, which the step then waits for."""
    overlap = import_step("step6_data_parallel_bucket", "overlap_timeline")

    class Handle:  # a collective that takes 20 ms
        def __init__(self):
            self.done = time.time_ns() + 20_000_000

        def wait(self):
            time.sleep(max(0, self.done - time.time_ns()) / 1e9)

    buckets = [
        SimpleNamespace(grad_data=torch.zeros(numel), collective="all-reduce", dp_group=None)
        for numel in (2**18, 2**17)  # 1 MB and 0.5 MB of fp32
    ]
    timeline = overlap.OverlapTimeline()
    timeline.watch(buckets)
    timeline.gradient_ready()
    for bucket, pause in zip(buckets, [0.002, 0.023], strict=True):
        time.sleep(pause)
        with timeline.launch(bucket):
            bucket.handle = Handle()
    time.sleep(0.008)
    timeline.gradient_ready()
    with timeline.wait():
        for bucket in buckets:
            bucket.handle.wait()
    assert timeline.launched_in_backward == 2
    backward, busy, during, waited = timeline.summary()
    # Sleeps may overrun on a busy machine: the bounds leave room for that.
    assert 32 <= backward < 60 and 39 <= busy < 70 and 4 <= waited < 30
    assert during == pytest.approx((busy - waited) / busy, abs=0.1)
    path = tmp_path / "dp.json"
    path.write_text(json.dumps({"traceEvents": timeline.trace_events(), "otherData": {}}))
    return path


def test_overlap_trace_has_the_backward_and_each_bucket(tmp_path):
    events = json.loads(overlap_trace(tmp_path).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "backward", 1: "bucket 0", 2: "bucket 1"}
    spans = {(e["tid"], e["cat"]): e for e in events if e["ph"] == "X"}
    assert set(spans) == {(0, "backward"), (0, "wait"), (1, "all-reduce"), (2, "all-reduce")}
    backward, wait = spans[0, "backward"], spans[0, "wait"]
    first, second = spans[1, "all-reduce"], spans[2, "all-reduce"]
    assert backward["ts"] == 0 and backward["ts"] + backward["dur"] <= wait["ts"]
    assert first["name"] == "all-reduce 1.00 MB" and second["name"] == "all-reduce 0.50 MB"
    assert first["ts"] + first["dur"] < backward["dur"]  # hidden behind backward
    assert second["ts"] + second["dur"] > backward["dur"]  # finished while the step waited
    assert all(19_500 <= e["dur"] for e in (first, second))  # microseconds


def test_plot_timeline_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace, out = schedule_trace(tmp_path), tmp_path / "docs" / "timeline.png"
    dp_trace = overlap_trace(tmp_path)  # a pipeline and a data-parallel panel, one time axis
    command = [sys.executable, str(ROOT / "tools" / "plot_timeline.py"), str(trace), str(dp_trace)]
    result = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import plot_timeline
    finally:
        sys.path.remove(str(ROOT / "tools"))
    names, rows, info = plot_timeline.read_trace(trace)
    assert names == ["stage 0", "stage 1"]
    assert [plot_timeline.pipeline_figures(row)[1] for row in rows] == [2, 1]  # peak in flight
    assert "bubble per stage" in plot_timeline.title(trace, names, rows, info)


def test_plot_timeline_refuses_what_is_not_a_trace_in_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import plot_timeline
    finally:
        sys.path.remove(str(ROOT / "tools"))
    span = '{"ph": "X", "ts": 0, "dur": 1, "cat": "forward"}'  # no track (tid)
    cases = [
        ("missing.json", None, "missing.json: not a readable JSON trace"),
        ("object.json", "{}", "object.json: not a Chrome trace (no list of traceEvents)"),
        ("no_track.json", f'{{"traceEvents": [{span}]}}', "a trace event lacks a field: 'tid'"),
    ]
    for name, text, message in cases:
        if text is not None:
            (tmp_path / name).write_text(text)
        code = plot_timeline.main([str(tmp_path / name), "-o", str(tmp_path / "out.png")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("plot_timeline.py: error: ") and message in err, err
        assert len(err.splitlines()) == 1
    assert not (tmp_path / "out.png").exists()


def test_plot_timeline_without_matplotlib_says_how_to_install_it():
    block = "import sys; sys.modules['matplotlib'] = None; sys.argv[1:] = ['x.json']; "
    run = "import runpy; runpy.run_path('tools/plot_timeline.py', run_name='__main__')"
    result = subprocess.run(
        [sys.executable, "-c", block + run], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 2
    assert 'needs matplotlib: pip install -e ".[plot]"' in result.stderr
