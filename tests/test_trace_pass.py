"""benchmarks/trace_pass.py's trace summary on a hand-built Perfetto event list."""

from __future__ import annotations

from benchmarks.trace_pass import summarize_trace


def test_summary_sums_each_track_and_ranks_its_events():
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "M", "pid": 1, "tid": 11, "name": "thread_name", "args": {"name": "tf_XLAEigen"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}}]
    x = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = meta + [x(1, 10, "dispatch", 0, 100), x(1, 10, "read", 150, 50), x(1, 10, "dispatch", 300, 120),
                     x(1, 11, "eigen work", 0, 5000),  # neither the Python thread nor a GPU stream
                     x(2, 7, "fusion_1", 20, 30), x(2, 7, "triton_attention", 60, 200)]
    got = summarize_trace(events, top=5)
    assert set(got) == {"/host:CPU | python", "/device:GPU:0 | Stream #7"}
    host = got["/host:CPU | python"]
    assert host["events"] == 3 and host["summed_ms"] == 0.27 and host["span_ms"] == 0.42
    assert host["top"] == [{"name": "dispatch", "count": 2, "ms": 0.22}, {"name": "read", "count": 1, "ms": 0.05}]
    gpu = got["/device:GPU:0 | Stream #7"]
    assert [e["name"] for e in gpu["top"]] == ["triton_attention", "fusion_1"] and gpu["span_ms"] == 0.24
