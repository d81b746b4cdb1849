"""The grammar compile server: one process per engine process, each compile in a child of it.

``python -m brigade.plugins.grammar.compile_worker FD`` is started by
:mod:`brigade.plugins.grammar.compile_pool` with a socket at descriptor ``FD``. It imports
XGrammar once, keeps the tokenizer infos it is sent, and forks one child per compile (the
server itself stays single-threaded, so forking it is safe and takes milliseconds). A child
compiles and checks the limits (compiled size, the first mask's CPU time), then answers
whether the grammar may be used; the parent compiles it again itself, a compile now known to
end in time (cheaper than sending a compiled grammar across: its serialized form is many
times larger than its compile is slow). A child's time limit is CPU time (the kernel ends it
with SIGXCPU, so a busy machine does not make a grammar too slow); the server kills a child
the parent cancels or that waited ten times its limit, and exits, killing its children, when
the parent goes away.

Messages (pickled tuples over the socket), from the parent: ``("tokenizer", key, info_json)``,
``("compile", job_id, key, kind, spec, limits)``, ``("cancel", job_id)``; to the parent:
``("done", job_id, status, reason)`` with status ``ok`` or ``error`` (then the reason).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import resource
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from brigade.interfaces import StructuredOutput
from brigade.plugins.grammar.schema_checks import (
    CPP_PREFIX,
    check_json_schema,
    check_regex,
    describe_kind,
    lengths_as_patterns,
    prepare_tag_schemas,
)

__all__ = ["CompileLimits", "check_spec", "compile_spec", "main"]


WAIT_FACTOR = 10
"""A compile is stopped after this many times its CPU-time limit of waiting, whatever its
CPU time (a machine too busy to run it at all)."""


@dataclasses.dataclass(frozen=True)
class CompileLimits:
    """A compile's bounds and whitespace rule (one backend's options)."""

    max_whitespace: int
    timeout_s: float
    max_compiled_bytes: int
    mask_budget_s: float


@dataclasses.dataclass
class _Child:
    pid: int
    conn: Connection
    deadline: float
    job_id: int
    kind: str
    timeout_s: float


def main(fd: int) -> None:
    """Serve the parent at socket ``fd`` until it goes away."""
    _yield_the_cpu()  # importing XGrammar (and torch) takes seconds of CPU already
    import xgrammar  # noqa: F401 - once here, not in every child

    parent = Connection(socket.socket(fileno=fd).detach())
    infos: dict[str, Any] = {}
    children: dict[int, _Child] = {}  # by job id
    try:
        while True:
            now = time.monotonic()
            timeout = min((c.deadline for c in children.values()), default=now + 3600) - now
            ready = wait([parent, *(c.conn for c in children.values())], max(timeout, 0))
            if parent in ready:
                try:
                    message = parent.recv()
                except (EOFError, OSError):
                    return
                _handle(message, parent, infos, children)
            for child in list(children.values()):
                if child.conn in ready:
                    _collect(child, parent, children)
                elif time.monotonic() >= child.deadline:
                    _stop(child, children)
                    parent.send(("done", child.job_id, "error", _starved(child)))
    finally:
        for child in list(children.values()):
            _stop(child, children)


def _handle(
    message: tuple[Any, ...],
    parent: Connection,
    infos: dict[str, Any],
    children: dict[int, _Child],
) -> None:
    if message[0] == "tokenizer":
        _, key, info_json = message
        if key not in infos:
            import xgrammar as xgr

            infos[key] = xgr.TokenizerInfo.deserialize_json(info_json)
    elif message[0] == "cancel":
        child = children.get(message[1])
        if child is not None:
            _stop(child, children)
    else:  # compile
        _, job_id, key, kind, spec, limits = message
        children[job_id] = _fork(job_id, infos[key], StructuredOutput(kind, spec), limits)


def _fork(job_id: int, info: Any, spec: StructuredOutput, limits: CompileLimits) -> _Child:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: compile, answer, leave without running any cleanup
        code = 0
        try:
            ours.close()
            _die_with_parent()
            # The limit is CPU time (a busy machine does not make a grammar too slow): past
            # it the kernel ends this child with SIGXCPU.
            cpu_s = max(1, math.ceil(limits.timeout_s))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            answer = Connection(theirs.detach())
            answer.send(check_spec(info, spec, limits))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    deadline = time.monotonic() + WAIT_FACTOR * limits.timeout_s
    return _Child(pid, Connection(ours.detach()), deadline, job_id, spec.kind, limits.timeout_s)


def _yield_the_cpu() -> None:
    """Run (and fork compiles that run) only on CPU time the engine leaves idle: Linux's
    SCHED_IDLE, else the lowest priority. A compile starved for long is stopped all the same
    (:data:`WAIT_FACTOR`)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(19)


def _die_with_parent() -> None:
    """Ask Linux to kill this child if the server dies first (else a compile would run on)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server kills its children itself
        pass


def _collect(child: _Child, parent: Connection, children: dict[int, _Child]) -> None:
    try:
        status, payload = child.conn.recv()
    except (EOFError, OSError):  # it died: of its CPU limit, or it crashed
        ended = _stop(child, children, kill=False)
        status = "error"
        if os.WIFSIGNALED(ended) and os.WTERMSIG(ended) == signal.SIGXCPU:
            payload = _too_slow(child)
        else:
            payload = f"compiling this {describe_kind(child.kind)} crashed"
    else:
        _stop(child, children)
    parent.send(("done", child.job_id, status, payload))


def _stop(child: _Child, children: dict[int, _Child], *, kill: bool = True) -> int:
    """Forget and reap the child (killed first unless it is ending); its wait status."""
    children.pop(child.job_id, None)
    child.conn.close()
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
    try:
        return os.waitpid(child.pid, 0)[1]
    except ChildProcessError:
        return 0


def _too_slow(child: _Child) -> str:
    return (
        f"compiling this {describe_kind(child.kind)} took longer than [grammar] "
        f"compile_timeout_s = {child.timeout_s:g} (CPU time): simplify it (fewer enum values "
        "or choices, smaller repetition counts, less nesting)"
    )


def _starved(child: _Child) -> str:
    return (
        f"compiling this {describe_kind(child.kind)} did not finish within "
        f"{WAIT_FACTOR} x [grammar] compile_timeout_s = {WAIT_FACTOR * child.timeout_s:g} s "
        "of waiting (the server is overloaded); try again later"
    )


# -- one compile (in a child) ----------------------------------------------------------------


def check_spec(info: Any, spec: StructuredOutput, limits: CompileLimits) -> tuple[str, str]:
    """Compile ``spec`` and check its limits: ``("ok", "")`` or ``("error", why)``."""
    import xgrammar as xgr

    # Its cache dedups a grammar's repeated parts (a schema's many alike strings).
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    try:
        compiled = compile_spec(compiler, spec, limits.max_whitespace)
    except ValueError as exc:
        return "error", str(exc)
    size = compiled.memory_size_bytes
    if size > limits.max_compiled_bytes:
        return "error", (
            f"the compiled {describe_kind(spec.kind)} takes {size / 2**20:.1f} MiB, more than "
            f"[grammar] cache_mib = {limits.max_compiled_bytes / 2**20:g} allows: simplify it "
            "(fewer enum values or choices)"
        )
    took = _first_mask_seconds(compiled, info)
    if took > limits.mask_budget_s:
        return "error", (
            f"structured output: the first token mask of this {describe_kind(spec.kind)} took "
            f"{took * 1000:.0f} ms to compute, more than [grammar] mask_budget_ms = "
            f"{limits.mask_budget_s * 1000:g}: the grammar is too ambiguous to enforce token by "
            "token (e.g. nested repetitions such as (.{0,100}){0,100}); simplify it"
        )
    return "ok", ""


def _first_mask_seconds(compiled: Any, info: Any) -> float:
    """CPU seconds the grammar's first mask takes (CPU, not wall time: a busy machine does
    not make a grammar too slow)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    started = time.process_time()
    matcher.fill_next_token_bitmask(bitmask, 0)
    return time.process_time() - started


def compile_spec(compiler: Any, spec: StructuredOutput, max_whitespace: int) -> Any:
    """``spec`` compiled by ``compiler`` (an ``xgrammar.GrammarCompiler``), or ``ValueError``
    saying why not."""
    try:
        return _compile(compiler, spec, max_whitespace)
    except ValueError:
        raise
    except Exception as exc:  # XGrammar raises RuntimeError and its own errors
        message = CPP_PREFIX.sub("", str(exc).strip())
        raise ValueError(f"invalid {describe_kind(spec.kind)}: {message}") from None


def _compile(compiler: Any, spec: StructuredOutput, max_whitespace: int) -> Any:
    whitespace: dict[str, Any] = (
        {"any_whitespace": True, "max_whitespace_cnt": max_whitespace}
        if max_whitespace
        else {"any_whitespace": False}
    )
    if spec.kind == "json":
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec)
        check_json_schema(schema)
        return compiler.compile_json_schema(json.dumps(lengths_as_patterns(schema)), **whitespace)
    if spec.kind == "regex":
        check_regex(spec.spec)
        return compiler.compile_regex(spec.spec)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.spec)
    if spec.kind == "structural_tag":
        tag = json.loads(spec.spec)
        prepare_tag_schemas(tag, max(1, max_whitespace))
        return compiler.compile_structural_tag(json.dumps(tag))
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
