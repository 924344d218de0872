"""A Python process started in a fraction of a second: forked from a warm one (a zygote).

    zygote = Zygote(command, env, preload=("torch", "torch._dynamo", "ringtrain.cli.train"))
    ...
    if zygote.ready():                                  # imports done (never blocks)
        proc = zygote.fork(command, env, stdout=log, stderr=log)   # a Popen-like handle
    zygote.close()

Why: a cold `python -u -m ringtrain train` spends ~4.5 s of a core importing (torch 2.3 s,
torch._dynamo 1.8 s through the first optimizer, ringtrain 0.4 s) before it builds anything.
In a live job (`live_agent.py`) every replacement and every new warm spare paid that, and on
cores the job shares with it much more (~30 s at nice 19 in benchmarks/live_recovery.py, most
of the 10-s-fault runs' loss). The zygote (`zygote_server.py`) imports once; each fork is a copy
with the imports done, which only builds its model and joins.

What a forked process is, compared with `Popen(command, env=env, start_new_session=True)`: the
same interpreter, flags, arguments, environment, working directory and output files; a session
of its own; stdin /dev/null; its command line as `ps`
and `pgrep -f` read it (up to `COMMAND_LINE_ROOM` bytes; the zygote's own is padded to that).
It is this process's child (the zygote double-forks and this process is a subreaper,
`become_subreaper`), so its exit code is read and its group signalled as a Popen's:
`ForkedProcess` has Popen's `pid`, `args`, `returncode`, `poll`, `wait`, `send_signal`,
`terminate` and `kill`. Any other descendant that is orphaned (a killed worker's own children)
now comes to this process too, and stays a zombie until it exits (nothing waits for pids it
does not know; the kernel reaps them then).

Only a command of the form `PYTHON [-u] -m MODULE ARGS` or `PYTHON [-u] SCRIPT ARGS` forks
(`forkable`), and only from a zygote of the same interpreter and flags. The environment a
library reads when it is loaded (OMP_NUM_THREADS, MALLOC_*) is the zygote's: start it with
the environment of the processes it will fork. Linux only (prctl); elsewhere `Zygote` raises
`ZygoteError` and the caller starts processes as before.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

__all__ = ["ForkedProcess", "Zygote", "ZygoteError", "become_subreaper", "forkable"]

PR_SET_CHILD_SUBREAPER = 36
# Bytes of command line a fork can show as its own (`ps`, `pgrep -f`, /proc/PID/cmdline): the
# zygote's is padded to this, and each fork writes its command there (`zygote_server.retitle`).
COMMAND_LINE_ROOM = 4096
Target = tuple[str, str]  # ("module", "ringtrain") or ("script", "/path/to/worker.py")


class ZygoteError(RuntimeError):
    """The zygote cannot fork this (or any more): start the process as before."""


def become_subreaper() -> None:
    """Make this process the parent of any orphaned descendant (Linux `PR_SET_CHILD_SUBREAPER`):
    the zygote's grandchildren come here when their middle parent exits."""
    if not sys.platform.startswith("linux"):
        raise ZygoteError(f"forking from a warm process needs Linux (this is {sys.platform})")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        why = os.strerror(ctypes.get_errno())
        raise ZygoteError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {why}")


def forkable(command: Sequence[str]) -> tuple[tuple[str, ...], Target, list[str]] | None:
    """(interpreter and flags, target, sys.argv) of `PYTHON [-u] (-m MODULE | SCRIPT) ARGS`,
    or None for any other command (other flags, a wrapper, not Python)."""
    command = [str(c) for c in command]
    if len(command) < 2 or "python" not in os.path.basename(command[0]):
        return None
    at = 1
    while at < len(command) and command[at] == "-u":
        at += 1
    if at >= len(command):
        return None
    if command[at] == "-m":
        if at + 1 >= len(command):
            return None
        name = command[at + 1]
        return tuple(command[:at]), ("module", name), [name, *command[at + 2:]]
    if command[at].startswith("-"):
        return None
    return tuple(command[:at]), ("script", command[at]), command[at:]


class ForkedProcess:
    """A forked process, waited on as `subprocess.Popen` waits on its child."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost, not its death
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # once reaped, its pid may be another process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode})"


def _fd(stream: IO | int | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


class Zygote:
    """A warm process of `interpreter` (PYTHON and its flags) that imported `preload`, and forks.

    Args:
        interpreter: the command's interpreter and flags (`forkable(command)[0]`).
        env: the zygote's environment: that of the processes it will fork (see the module).
        preload: modules imported once, before any fork.
        popen: how to start it, called as Popen is with `env`, `stdin`, `stderr` and `pass_fds`
            (default: `subprocess.Popen` in a session of its own; a network-namespace host's).
    """

    def __init__(self, interpreter: Sequence[str], env: Mapping[str, str],
                 preload: Sequence[str], *, popen: Callable[..., subprocess.Popen] | None = None,
                 stderr: IO | int | None = None):
        become_subreaper()
        self.interpreter = tuple(interpreter)
        self.info: dict | None = None  # the ready message: pid, import_s
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = (popen or functools.partial(subprocess.Popen, start_new_session=True))(
                [*self.interpreter, "-m", "ringtrain.launch.zygote_server",
                 str(theirs.fileno()), *preload, "--room", "." * COMMAND_LINE_ROOM],
                env=dict(env), stdin=subprocess.DEVNULL, stderr=stderr,
                pass_fds=[theirs.fileno()])
        finally:
            theirs.close()

    @classmethod
    def forked_here(cls, interpreter: Sequence[str], env: Mapping[str, str],
                    preload: Sequence[str]) -> Zygote:
        """A zygote that is a fork of this process (a launcher: what it imported, torch, is
        not imported again, ~2 s of a core a job), made what a fresh `interpreter` of `env`
        would be before it imports `preload` (`zygote_server.main_forked`).

        Raises `ZygoteError` where a fork of this process would not be that: another Python
        than `interpreter`'s, interpreter options the workers' command lacks, a thread, CUDA.
        """
        from ringtrain.launch import zygote_server

        become_subreaper()
        if list(interpreter[1:]) not in ([], ["-u"]) or interpreter[0] != sys.executable:
            raise ZygoteError(f"this process runs {sys.executable}, not {list(interpreter)}")
        if options := _interpreter_options():
            raise ZygoteError(f"this Python was started with {options}")
        problem = zygote_server.fork_problem()
        if problem is not None:
            raise ZygoteError(problem)
        self = cls.__new__(cls)
        self.interpreter, self.info = tuple(interpreter), None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):  # else the child's copy is printed again
            stream.flush()
        pid = os.fork()
        if pid == 0:
            try:
                self._sock.close()
                zygote_server.main_forked(
                    theirs, dict(env), list(preload),
                    ["ringtrain.launch.zygote_server", "(forked from", f"{os.getppid()})"],
                    unbuffered="-u" in interpreter)
            finally:
                os._exit(70)  # never back into this process's own code
        theirs.close()
        self.proc = ForkedProcess(pid, ["ringtrain.launch.zygote_server"])
        return self

    def ready(self) -> bool:
        """Whether the zygote has imported everything and forks now (never blocks)."""
        if self.info is None and self.proc.poll() is None:
            try:
                data = self._sock.recv(4096, socket.MSG_DONTWAIT)
            except OSError:  # nothing yet (BlockingIOError), or the socket is gone
                return False
            if data:
                self.info = json.loads(data)
        return self.info is not None and self.proc.poll() is None

    def wait_ready(self, within_s: float) -> bool:
        """Wait until the zygote forks (True), it exited, or `within_s` passed (False)."""
        deadline = time.monotonic() + within_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def fork(self, command: Sequence[str], env: Mapping[str, str], *,
             cwd: str | None = None, stdout: IO | int | None = None,
             stderr: IO | int | None = None,
             nice: int = 0, timeout: float = 10.0) -> ForkedProcess:
        """`command` started as a forked copy of the zygote (see the module docstring).

        stdout/stderr: a file, a descriptor, `subprocess.STDOUT` (stderr only) or None (this
        process's own). nice: the process's and its session's autogroup nice while it runs.
        Raises `ZygoteError` when it cannot (not ready, another interpreter, the zygote gone
        or refusing): start it as before then.
        """
        parsed = forkable(command)
        if parsed is None:
            raise ZygoteError(f"not a Python module or script command: {list(command)}")
        interpreter, target, argv = parsed
        if interpreter != self.interpreter:
            raise ZygoteError(f"the zygote runs {list(self.interpreter)}, not "
                              f"{list(interpreter)}")
        if not self.ready():
            raise ZygoteError("the zygote is not ready (still importing, or exited with "
                              f"{self.proc.returncode})")
        out = _fd(stdout, 1)
        err = out if stderr == subprocess.STDOUT else _fd(stderr, 2)
        request = {"argv": argv, "command": [str(c) for c in command], "target": target,
                   "env": dict(env), "cwd": cwd or os.getcwd(),
                   "nice": nice}
        self._sock.settimeout(timeout)
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out, err])
            reply = json.loads(self._sock.recv(4096) or b'{"error": "the zygote exited"}')
        except (OSError, ValueError) as e:
            raise ZygoteError(f"the zygote did not answer: {e!r}") from e
        finally:
            self._sock.settimeout(None)
        if "error" in reply:
            raise ZygoteError(reply["error"])
        proc = ForkedProcess(reply["pid"], command)
        if _parent(proc.pid) != os.getpid():  # not ours to wait for: no handle can be honest
            os.killpg(proc.pid, signal.SIGKILL)
            raise ZygoteError(f"the forked process {proc.pid} is not this process's child "
                              "(is this process a subreaper?)")
        return proc

    def close(self, grace_s: float = 2.0) -> None:
        """Stop the zygote (its forked processes go on)."""
        self._sock.close()
        try:
            self.proc.wait(timeout=grace_s)  # it exits when its end of the socket closes
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _interpreter_options() -> list[str]:
    """This Python's options that change how code runs (-O, -X, -W, -I, -S, -E, ...): a
    fork of it would carry them into workers whose command has none."""
    names = ("optimize", "dev_mode", "isolated", "no_site", "ignore_environment", "safe_path",
             "bytes_warning", "verbose", "inspect", "interactive")
    found = [f"sys.flags.{n}" for n in names if getattr(sys.flags, n, 0)]
    return found + [f"-X {k}" for k in sys._xoptions] + [f"-W {w}" for w in sys.warnoptions]


def _parent(pid: int) -> int | None:
    """`pid`'s parent, from /proc (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
