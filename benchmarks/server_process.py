"""A `serving.launch` process for the benchmarks that measure the server from outside.

One way to start it on a free loopback port, wait for /health and stop it, so the soak test, the
arm comparison and the start-up benchmark cannot drift apart in how they do it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Loopback only: an http_proxy in the environment must not route /health through a proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET, or a POST of `body` as JSON; status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def launch(server_args: list[str], log_path: Path, *, port: int | None = None,
           env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start `python -m serving.launch` on 127.0.0.1 with its output in `log_path`; (process, base URL)."""
    port = port or free_port()
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "serving.launch", "--host", "127.0.0.1", "--port", str(port), *server_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen | None, base: str, timeout: float, log_path: Path | None = None) -> float:
    """Seconds until /health answers 200; raises with the log's tail if the process (None: a server started
    elsewhere) exits or time runs out."""
    t0 = time.perf_counter()
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy:\n{tail}")
        if http(base + "/health", timeout=2)[0] == 200:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the server at {base} was not healthy within {timeout:.0f} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM, then SIGKILL after `timeout`; the exit status."""
    proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
