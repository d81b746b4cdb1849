"""Engines side by side, taking turns: the driver processes of ``benchmarks/peers.py``.

The machines these benchmarks run on drift: the same engine on the same workload ran 25-30%
slower for tens of minutes and then faster again (2026-12-02, a 2-core AMD EPYC VM), so engines
measured one after the other compare the machine's moods as much as the engines. Here every
engine of a group is started and loaded first, then each warm-up and each timed run of a
workload goes to the engines in turn (A B C, then C B A, ...), one running at a time while the
others are stopped (SIGSTOP to the driver's process group: vLLM's idle worker otherwise spins
on its message queue and takes a core from whoever runs). Each engine's median then comes from
runs spread across the same minutes as the others' (the protocol's side is
``peer_protocol.Turns``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Driver", "run_group"]


class EngineLike(Protocol):
    name: str
    python: Path
    driver: str
    env: dict[str, str]


class Driver:
    """One driver process, its job and result files, and the two ends of its turn pipes."""

    def __init__(
        self, engine: EngineLike, job: dict[str, Any], drivers: Path, workdir: Path, logs: Path
    ) -> None:
        tag = f"{engine.name}-{'prefix' if job['prefix_caching'] else 'plain'}"
        self.name = engine.name
        job_path, self.result_path = workdir / f"{tag}.job", workdir / f"{tag}.out"
        self.log_path = logs / f"{tag}.log"
        job_path.write_text(json.dumps(job))
        go_read, self._go = os.pipe()
        self._done, done_write = os.pipe()
        env = {
            **os.environ,
            **engine.env,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PEERS_TURN_FDS": f"{go_read},{done_write}",
        }
        command = [
            str(engine.python),
            str(drivers / engine.driver),
            str(job_path),
            str(self.result_path),
        ]
        with self.log_path.open("w") as log:
            # Its own session, so a kill ends the driver and any workers it started (vLLM's).
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(go_read, done_write),
            )
        os.close(go_read)
        os.close(done_write)
        self._buffer = b""
        self.error = ""

    def hear(self, timeout: float) -> str:
        """The driver's next word ('loaded', 'done', 'failed'), or '' when it died or ran past
        ``timeout`` (then ``error`` says which and the driver is killed)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            ready = select.select([self._done], [], [], remaining)[0] if remaining > 0 else []
            if not ready:
                self.error = f"timed out after {timeout:.0f} s"
                self.kill()
                return ""
            chunk = os.read(self._done, 4096)
            if not chunk:
                code = self.process.wait()
                self.error = f"exited with status {code}" if code else "exited early"
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()

    def turn(self, timeout: float) -> str:
        """Wake the driver, let it run its next call, stop it again; its answer (see
        :meth:`hear`)."""
        self.signal(signal.SIGCONT)
        try:
            os.write(self._go, b"go\n")
        except BrokenPipeError:
            code = self.process.wait()
            self.error = f"exited with status {code}" if code else "exited early"
            return ""
        word = self.hear(timeout)
        self.signal(signal.SIGSTOP)
        return word

    def signal(self, number: int) -> None:
        """Send ``number`` to the driver and every process it started (its process group)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, number)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=60)

    def finish(self, timeout: float) -> dict[str, Any]:
        """Close the turn pipes, wait for the driver to write its results and exit (kill it
        after ``timeout``); its results so far."""
        self.signal(signal.SIGCONT)
        os.close(self._go)
        try:
            code = self.process.wait(timeout=timeout)
            if code and not self.error:
                self.error = f"exited with status {code}"
        except subprocess.TimeoutExpired:
            self.kill()
            self.error = self.error or f"did not exit within {timeout:.0f} s"
        os.close(self._done)
        path = self.result_path
        return json.loads(path.read_text()) if path.exists() else {}


def run_group(
    engines: list[EngineLike],
    jobs: dict[str, dict[str, Any]],
    drivers: Path,
    workdir: Path,
    logs: Path,
    timeout: float,
) -> dict[str, tuple[dict[str, Any], str]]:
    """Start every engine's driver on its job (the jobs hold the same workloads), wait until
    all are loaded, then give them each call in turn; engine -> (results, error or '')."""
    started = {
        engine.name: Driver(engine, jobs[engine.name], drivers, workdir, logs) for engine in engines
    }
    alive = []
    for name, driver in started.items():  # they load at once; each stops once it is up
        if driver.hear(timeout) == "loaded":
            driver.signal(signal.SIGSTOP)
            alive.append(name)
    workloads = jobs[engines[0].name]["workloads"] if engines else []
    for workload in workloads:
        active = list(alive)
        for call in range(1 + len(workload["runs"])):  # the warm-up, then each timed run
            order = list(active) if call % 2 == 0 else active[::-1]
            for name in order:
                word = started[name].turn(timeout)
                if word == "done":
                    continue
                active.remove(name)  # no more turns of this workload
                if word != "failed":  # dead: no more turns at all
                    alive.remove(name)
    outcome = {}
    for name, driver in started.items():
        result = driver.finish(timeout)
        outcome[name] = (result, driver.error)
    return outcome
