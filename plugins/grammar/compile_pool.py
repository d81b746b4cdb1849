"""Grammar compiles in child processes, so that a compile can be stopped.

A compile is native code that nothing can interrupt in a thread: a 50,000-value ``enum``
would keep a thread busy for minutes after its client left, slowing every other request.
So every compile runs in a process of its own, forked by one compile server per process
(``brigade.plugins.grammar.compile_worker``, started on the first compile; it imports XGrammar
once, so each fork takes milliseconds). A compile past its time limit, or one nobody waits
for any more, is killed. A grammar the child found within every limit is compiled again
here, on a thread: that compile is known to end in time. :class:`CompilePool` is one
backend's share: at most ``num_workers`` of its compiles run at once, the rest queue.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from brigade.interfaces import StructuredOutput
from brigade.plugins.grammar.compile_worker import CompileLimits, compile_spec

__all__ = ["CompileJob", "CompilePool"]

logger = logging.getLogger(__name__)


class CompileJob:
    """One spec being compiled, shared by every request that asked for it."""

    def __init__(self, spec: StructuredOutput) -> None:
        self.spec = spec
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        """The compiled grammar, or ``ValueError`` with the reason."""
        self.waiters = 0
        """Callers still waiting (the backend's count; 0 with the job not done: cancel it)."""


class _Server:
    """The process's compile server: one socket, one thread reading its answers."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "brigade.plugins.grammar.compile_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._handlers: dict[int, Callable[[str, str], None]] = {}
        self._tokenizers: set[str] = set()
        self._ids = itertools.count()
        self.alive = True
        threading.Thread(target=self._read, name="brigade-grammar-compiles", daemon=True).start()

    def compile(
        self,
        tokenizer: tuple[str, str],
        spec: StructuredOutput,
        limits: CompileLimits,
        on_done: Callable[[str, str], None],
    ) -> int:
        """Start a compile; ``on_done(status, payload)`` is called from the reader thread."""
        key, info_json = tokenizer
        job_id = next(self._ids)
        with self._send_lock:
            if key not in self._tokenizers:
                self.conn.send(("tokenizer", key, info_json))
                self._tokenizers.add(key)
            self._handlers[job_id] = on_done
            self.conn.send(("compile", job_id, key, spec.kind, spec.spec, limits))
        return job_id

    def cancel(self, job_id: int) -> None:
        with self._send_lock:
            if self._handlers.pop(job_id, None) is not None:
                self.conn.send(("cancel", job_id))

    def _read(self) -> None:
        try:
            while True:
                _, job_id, status, payload = self.conn.recv()
                with self._send_lock:
                    handler = self._handlers.pop(job_id, None)
                if handler is not None:
                    handler(status, payload)
        except (EOFError, OSError):
            pass
        self.alive = False
        with self._send_lock:
            handlers, self._handlers = self._handlers, {}
        for handler in handlers.values():
            handler("error", "the grammar compile server exited")


_server: _Server | None = None
_server_lock = threading.Lock()


def _compile_server() -> _Server:
    """The process's compile server, started (again, if it died) on first use."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive or _server.process.poll() is not None:
            _server = _Server()
        return _server


class CompilePool:
    """One backend's compiles: at most ``num_workers`` at once on the compile server.

    Its own thread talks to the server (the first compile builds the tokenizer info and may
    wait for the server to start), so :meth:`submit` and :meth:`cancel` never block."""

    def __init__(
        self,
        num_workers: int,
        limits: CompileLimits,
        tokenizer_info: Callable[[], tuple[Any, str]],
    ) -> None:
        """``tokenizer_info`` returns XGrammar's ``TokenizerInfo`` and its serialized form
        (called once, on the first compile)."""
        self.num_workers = num_workers
        self.limits = limits
        self._tokenizer_info = tokenizer_info
        self._info: tuple[Any, str, str] | None = None
        self._info_lock = threading.Lock()
        self._changed = threading.Condition()
        self._queued: deque[CompileJob] = deque()
        self._cancelled: list[tuple[_Server, int]] = []
        self._running: dict[CompileJob, tuple[_Server, int]] = {}
        self._thread: threading.Thread | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="brigade-grammar-compile"
        )
        self._compiler_lock = threading.Lock()
        self._grammar_compiler: Any = None
        self._closed = False
        self.num_compiled = 0
        """Compiles started so far."""

    def submit(self, job: CompileJob) -> None:
        with self._changed:
            self._queued.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._dispatch, name="brigade-grammar-dispatch", daemon=True
                )
                self._thread.start()
            self._changed.notify()

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for ``job`` any more: drop it, or kill its compile."""
        with self._changed:
            if job in self._queued:
                self._queued.remove(job)
                return
            running = self._running.pop(job, None)
            if running is not None:
                self._cancelled.append(running)
                self._changed.notify()

    def shutdown(self) -> None:
        """Stop this backend's compiles (the server stays for other backends)."""
        with self._changed:
            self._closed = True
            self._cancelled.extend(self._running.values())
            jobs = [*self._running, *self._queued]
            self._running, self._queued = {}, deque()
            self._changed.notify()
        self._threads.shutdown(wait=False, cancel_futures=True)
        for job in jobs:
            _fail(job, "the engine stopped")

    # -- the dispatch thread ------------------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            with self._changed:
                while not (self._cancelled or self._closed or self._can_start()):
                    self._changed.wait()
                cancelled, self._cancelled = self._cancelled, []
                job = self._queued.popleft() if self._can_start() else None
                closed = self._closed
            for server, job_id in cancelled:
                server.cancel(job_id)
            if closed:
                return
            if job is not None:
                self._start(job)

    def _can_start(self) -> bool:
        return not self._closed and bool(self._queued) and len(self._running) < self.num_workers

    def _start(self, job: CompileJob) -> None:
        try:
            info = self.tokenizer()
            server = _compile_server()
            with self._changed:  # answers may come at once: be in _running first
                self._running[job] = (server, -1)
                self.num_compiled += 1
            job_id = server.compile(
                (info[1], info[2]),
                job.spec,
                self.limits,
                lambda status, payload: self._finished(job, status, payload),
            )
        except (ValueError, OSError) as exc:  # no tokenizer, or no server
            with self._changed:
                self._running.pop(job, None)
            reason = str(exc) if isinstance(exc, ValueError) else f"no compile server: {exc}"
            _fail(job, reason)
            return
        with self._changed:
            still_wanted = job in self._running
            if still_wanted:
                self._running[job] = (server, job_id)
        if not still_wanted:  # cancelled before its id was known
            server.cancel(job_id)

    def _finished(self, job: CompileJob, status: str, reason: str) -> None:
        """The child's verdict: refused (why), or within the limits: compile it here (a
        compile now known to end in time) on one of :attr:`num_workers` threads."""
        with self._changed:
            self._running.pop(job, None)
            self._changed.notify()
        if status != "ok":
            _fail(job, reason)
        elif not job.future.done():
            self._threads.submit(self._compile_here, job)

    def _compile_here(self, job: CompileJob) -> None:
        if job.future.done():  # cancelled meanwhile
            return
        _lower_this_thread()
        try:
            compiled = compile_spec(self._compiler(), job.spec, self.limits.max_whitespace)
        except ValueError as exc:
            _fail(job, str(exc))
            return
        except Exception as exc:
            _fail(job, f"the grammar compile failed: {exc}")
            return
        if not job.future.done():
            job.future.set_result(compiled)

    def _compiler(self) -> Any:
        with self._compiler_lock:
            if self._grammar_compiler is None:
                import xgrammar as xgr

                self._grammar_compiler = xgr.GrammarCompiler(
                    self.tokenizer()[0],
                    max_threads=1,
                    cache_enabled=True,
                    cache_limit_bytes=self.limits.max_compiled_bytes,
                )
            return self._grammar_compiler

    def tokenizer(self) -> tuple[Any, str, str]:
        """The tokenizer info, its key (a digest) and its serialized form (built on first
        use; ``ValueError`` without a tokenizer)."""
        with self._info_lock:
            if self._info is None:
                info, serialized = self._tokenizer_info()
                key = hashlib.sha256(serialized.encode()).hexdigest()
                self._info = (info, key, serialized)
            return self._info


def _lower_this_thread() -> None:
    """The compile thread at the lowest priority, so that the step loop's threads get the
    CPU first (Linux sets it per thread; elsewhere this does nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _fail(job: CompileJob, reason: str) -> None:
    if not job.future.done():
        job.future.set_exception(ValueError(reason))
