"""The pictures and measures of a run: FLOP/s and MFU on the step line, --profile's traces, the
pipeline Schedule's Chrome trace and tools/plot_timeline.py that draws it."""

import json
import subprocess
import sys
import time
from itertools import pairwise

import pytest
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


def test_profile_refuses_a_run_too_short_to_record():
    args = [*TINY, "--max_steps", "2", "--profile", "p"]
    result = run_step("step3_dataloader", args, torchrun=False)
    assert result.returncode == 2
    assert "--profile records steps 3 to 5; --max_steps 2 stops before" in result.stderr


def schedule_trace(tmp_path):
    """A trace written the way train.py writes it, from two Schedules run in this process: stage
    0 runs F1 F2 B1 B2, stage 1 F1 B1 F2 B2, with a pause between every two spans."""
    pp = import_step(ONE_F_ONE_B, "pipeline_parallel")
    train = import_step(ONE_F_ONE_B, "train")
    stages = []
    for order in (["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]):
        schedule = pp.Schedule()
        for item in order:
            time.sleep(0.002)
            with schedule.run(item[0], int(item[1])):
                time.sleep(0.003)
        assert schedule.peak_in_flight == (2 if order[1] == "F1" else 1)
        stages.append(schedule.trace_events(len(stages), time.time_ns()))
    path = tmp_path / "trace.json"
    train.write_trace(path, stages, {"engine": "test", "pp_size": 2, "micro_batches": 2})
    return path


def test_schedule_trace_has_every_span_and_the_waits_between(tmp_path):
    trace = json.loads(schedule_trace(tmp_path).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0
    for stage, expected in enumerate([["F1", "F2", "B1", "B2"], ["F1", "B1", "F2", "B2"]]):
        row = sorted((e for e in spans if e["tid"] == stage), key=lambda e: e["ts"])
        # A wait before and after every forward and backward (each was preceded by a pause).
        assert [e["name"] for e in row[1::2]] == expected
        assert {e["cat"] for e in row[::2]} == {"wait"} and len(row) == 2 * len(expected) + 1
        for before, after in pairwise(row):
            assert before["ts"] + before["dur"] == after["ts"]  # the spans tile the step
        assert all(2900 <= e["dur"] for e in row[1::2])  # microseconds


def test_plot_timeline_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace, out = schedule_trace(tmp_path), tmp_path / "docs" / "timeline.png"
    command = [sys.executable, str(ROOT / "tools" / "plot_timeline.py"), str(trace), str(trace)]
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


def test_plot_timeline_without_matplotlib_says_how_to_install_it():
    block = "import sys; sys.modules['matplotlib'] = None; sys.argv[1:] = ['x.json']; "
    run = "import runpy; runpy.run_path('tools/plot_timeline.py', run_name='__main__')"
    result = subprocess.run(
        [sys.executable, "-c", block + run], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 2
    assert 'needs matplotlib: pip install -e ".[plot]"' in result.stderr
