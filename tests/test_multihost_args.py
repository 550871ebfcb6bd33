"""Nodes of one multi-host engine must be started with the same engine flags: each process
compares its engine arguments with every other's before building anything, and all of them stop
with a clear error when one differs (tests/multihost_worker.py check-args, two processes on
localhost with gloo CPU collectives)."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_jax.server_args import ServerArgs
from tests.multihost_worker import run_two_ranks


def test_engine_args_leave_out_the_rank_and_the_http_server():
    a = ServerArgs(nnodes=2, node_rank=0, dist_init_addr="h:1", port=1, host="0.0.0.0", log_level="debug")
    b = ServerArgs(nnodes=2, node_rank=1, dist_init_addr="h:1", port=2)
    assert a.engine_args() == b.engine_args()
    assert "node_rank" not in a.engine_args() and "port" not in a.engine_args()
    assert a.engine_args() != ServerArgs(nnodes=2, node_rank=1, dist_init_addr="h:1", tp_size=2).engine_args()


def test_nodes_started_with_different_engine_flags_all_stop(tmp_path):
    out = tmp_path / "check"
    run_two_ranks(out, "check-args", timeout=300)
    leader, follower = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert leader is not None and "rank(s) [1]" in leader and "--node-rank" in leader
    assert follower is not None and "rank(s) [1]" in follower and "max_running_requests" in follower
