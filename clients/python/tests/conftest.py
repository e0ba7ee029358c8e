"""Fixtures: a real ``select-server`` per test, on a free loopback port, always stopped.

The binary is ``$KV_SELECT_SERVER`` (``cargo xtask ci`` sets it) or the workspace's debug
build. Each test gets its own server process so no state leaks between tests; the debug
binary starts in a few tens of milliseconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

import kv_select

REPO = Path(__file__).resolve().parents[3]
STARTUP_LIMIT_S = 20.0
STOP_LIMIT_S = 10.0
_LISTENING = re.compile(r"kv-select listening addr=127\.0\.0\.1:(\d+)")


def server_binary() -> Path:
    configured = os.environ.get("KV_SELECT_SERVER")
    binary = Path(configured) if configured else REPO / "target" / "debug" / "select-server"
    if not binary.is_file():
        pytest.fail(f"no select-server binary at {binary}: build it (cargo build -p select-server)")
    return binary


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stops the process and removes its log (pytest shows the failure; the log's
        directory would otherwise stay behind in the temp dir after every run)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_LIMIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_LIMIT_S)
        shutil.rmtree(self.log.parent, ignore_errors=True)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(
    args: list[str] | None = None, env: dict[str, str] | None = None, *, kv_events: bool = False
) -> Server:
    """Starts the server on 127.0.0.1 with ``--port 0`` and reads the bound port from its
    startup line; fails the test (after killing it) if that line does not come in time."""
    log_dir = Path(tempfile.mkdtemp(prefix="kv-select-pytest-"))
    log = log_dir / "server.log"
    full_env = dict(os.environ)
    full_env["DYN_ROUTER_USE_KV_EVENTS"] = "true" if kv_events else "false"
    full_env.update(env or {})
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [str(server_binary()), "--host", "127.0.0.1", "--port", "0", *(args or [])],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        m = _LISTENING.search(log.read_text(errors="replace"))
        if m:
            return Server(process, int(m.group(1)), log)
        if process.poll() is not None:
            break
        time.sleep(0.01)
    if process.poll() is None:
        process.kill()
        process.wait(STOP_LIMIT_S)
    output = log.read_text(errors="replace")
    shutil.rmtree(log_dir, ignore_errors=True)
    pytest.fail(f"select-server did not start within {STARTUP_LIMIT_S}s:\n{output}")


@pytest.fixture
def server_factory() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def factory(args: list[str] | None = None, env: dict[str, str] | None = None, *, kv_events: bool = False) -> Server:
        server = start_server(args, env, kv_events=kv_events)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def server(server_factory: Callable[..., Server]) -> Server:
    """A server in approximate mode (no KV events needed)."""
    return server_factory()


@pytest.fixture
def client(server: Server) -> Iterator[kv_select.Client]:
    with kv_select.Client(server.url, timeout=10.0) as c:
        yield c


def register(c: kv_select.Client, worker_id: int, **fields: object) -> kv_select.WorkerRecord:
    """A schedulable worker with block size 4 unless the test says otherwise."""
    fields.setdefault("endpoint", f"http://10.0.0.{worker_id}:8000")
    fields.setdefault("block_size", 4)
    record = c.upsert_worker(worker_id, **fields)  # type: ignore[arg-type]
    return record


def active_requests(c: kv_select.Client, model_name: str = "default") -> int:
    return sum(p.active_requests for p in c.loads(model_name=model_name))
