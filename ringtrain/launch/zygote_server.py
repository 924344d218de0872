"""The warm process of `zygote.py`: imports once, then forks a ready copy per request.

    python -u -m ringtrain.launch.zygote_server FD MODULE... --room ....   (by `Zygote` only)

FD is this end of the agent's socket pair (SOCK_SEQPACKET: one message a request); `--room`
pads this process's command line, which each child overwrites with its own (`retitle`). The
server imports each MODULE, says {"ready": ...}, then answers each request {"argv", "command",
"env", "cwd", "target", "nice"} (with the child's stdout and stderr passed as descriptors) with
{"pid": P} or {"error": why}. Each child is forked twice so that the first child's exit leaves
the second to the nearest subreaper above this process: the agent (`become_subreaper`), which
can then wait for it, read its exit code and signal it as its own. The child, a process of its
own session with its own environment, cwd and output, runs the target as `python -m MODULE` or
`python SCRIPT` would, with everything imported here already imported.

Or the launcher forks this process from itself (`main_forked`, by `Zygote.forked_here`): torch,
which the launcher imported, is then not imported a second time (~2 s of a core a job); what a
fork would carry over that an exec would not (signal handlers, the launcher's environment,
stdin, buffered output, OpenMP's thread count read at torch's load) is put as a fresh `python`
has it first (`as_fresh_interpreter`, `_threads_as_the_environment_says`).

Never touched here: CUDA (a forked CUDA context is unusable: `fork_problem` refuses to fork once
torch or anything else has initialised the driver; the driver's library loaded by
`import torch` is fine) and threads of Python's (a lock one holds at the fork
stays held in the child).
The server exits when the agent's end of the socket closes, or with the agent (PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import warnings

from ringtrain.launch.ending import end_now, exit_code

PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20  # a request: an environment of a few KB, a command line


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the agent) exits, however it exits."""
    with warnings.catch_warnings():
        libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def fork_problem() -> str | None:
    """Why forking now would hand the child a broken process, or None."""
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return f"a Python thread runs in the warm process ({', '.join(names)})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the warm process (a forked CUDA context is unusable)"
    if _cuda_driver_initialised():
        return "the CUDA driver is initialised in the warm process (a fork could not use CUDA)"
    return None


CUDA_ERROR_NOT_INITIALIZED = 3


def _cuda_driver_initialised() -> bool:
    """Whether this process called the driver's cuInit (then a fork's own CUDA calls fail),
    whatever torch knows: a device count or a library may have called it.

    A CUDA build of torch loads the driver library (libcuda.so) at `import torch` without
    initialising it (seen on an H100 and an H200, torch 2.11+cu130, session 22: the library's
    presence refused every fork), and a fork then uses CUDA as any process does (a raw fork on
    the H200, after torch, torch._dynamo, torch.optim and a device count): so the library being
    loaded is not the test. The driver's cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED
    before cuInit and initialises nothing; anything else (a count, or another error) is taken
    as initialised.
    """
    with open("/proc/self/maps") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/libcuda.so" in line}
    for path in sorted(paths):
        try:  # RTLD_NOLOAD: the handle of the library already loaded, never a second load
            driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            return True  # loaded but not reachable to ask: refuse rather than guess
        count = ctypes.c_int()
        if driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED:
            return True
    return False


def serve(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """Answer requests until the agent hangs up (None); in a forked child, return its request
    and descriptors (stdout, stderr) instead, for `run`."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except (ConnectionError, OSError):
            return None
        if not data:
            return None
        request = json.loads(data)
        problem = fork_problem()
        if problem is not None:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"error": problem}).encode())
            continue
        read, write = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns of any thread; `fork_problem` checked ours
            warnings.simplefilter("ignore", DeprecationWarning)
            middle = os.fork()
        if middle == 0:  # the first child: fork the worker, say its pid, exit (orphaning it)
            sock.close()
            os.close(read)
            me = os.getpid()
            child = os.fork()
            if child == 0:
                os.close(write)
                _reparented(me)
                return request, fds
            os.write(write, str(child).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            pid = pipe.read()
        os.waitpid(middle, 0)  # once it is reaped, the worker's parent is the subreaper
        for fd in fds:
            os.close(fd)
        reply = {"pid": int(pid)} if pid else {"error": "the fork failed (see the agent's log)"}
        sock.send(json.dumps(reply).encode())


def _reparented(middle: int, within_s: float = 5.0) -> None:
    """Wait until the middle child has exited and this process is the agent's: the command may
    ask to die with its parent (`ringtrain.launch.parent`), which must then be the agent, not
    the middle child that is about to exit (its death would kill the worker at once)."""
    deadline = time.monotonic() + within_s
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0005)


def run(request: dict, fds: list[int]) -> None:
    """Become the requested process (in the forked child) and run it to its exit code."""
    os.setsid()  # as Popen(start_new_session=True): the agent signals the whole group
    if request.get("nice"):  # the session's autogroup too: between sessions it is what counts
        if os.access("/proc/self/autogroup", os.W_OK):
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(request["nice"]))
        os.nice(request["nice"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, devnull), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
    for fd in {devnull, *fds}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _threads_as_the_environment_says()
    sys.argv = list(request["argv"])
    retitle(request["command"])
    kind, name = request["target"]

    def command() -> None:
        if kind == "module":  # as `python -m`: the working directory first on the path
            sys.path[0] = request["cwd"]
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(name))
            runpy.run_path(name, run_name="__main__")

    end_now(exit_code(command))  # not the warm process's shutdown: none of it is this child's


def _threads_as_the_environment_says() -> None:
    """torch's intra-op threads as a fresh interpreter of this environment has them: OpenMP
    reads OMP_NUM_THREADS once, when torch is loaded, which was in the warm process (or in the
    launcher it is a fork of, before torchrun set OMP_NUM_THREADS=1 for the workers)."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0 \
            and torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))


def retitle(command: list[str]) -> None:
    """Make `command` this process's command line as the kernel shows it (/proc/PID/cmdline:
    `ps`, `pgrep -f`), written over the interpreter's original argument strings, which
    nothing reads after start-up (CPython keeps copies): as much of it as the zygote's padded
    command line holds, the rest NULs. Nothing where /proc does not say where they are."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    except (OSError, IndexError, ValueError):
        return
    if not 0 < start < end:
        return
    data = b"\0".join(os.fsencode(a) for a in command)[:end - start - 1]
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def main() -> None:
    _die_with_parent()
    sock = socket.socket(fileno=int(sys.argv[1]))
    preload = sys.argv[2:sys.argv.index("--room")]
    retitle(sys.orig_argv[:sys.orig_argv.index("--room")])  # the room stays, unshown
    _import_then_serve(sock, preload, forked=False)


def main_forked(sock: socket.socket, env: dict[str, str], preload: list[str],
                title: list[str], unbuffered: bool) -> None:
    """The warm process as a fork of the process that asked for it (`Zygote.forked_here`, the
    launcher, which imported torch already): first made what a fresh `python [-u]` of `env`
    would be where a worker can tell (see `as_fresh_interpreter`), then as `main`. Never
    returns into the caller's code: it exits, or becomes a worker that exits."""
    os.setsid()  # as Popen(start_new_session=True): out of the launcher's process group
    _die_with_parent()
    as_fresh_interpreter(env, unbuffered)
    # Popen's close_fds: descriptors the launcher opened or inherited stay out of the workers.
    os.closerange(3, sock.fileno())
    os.closerange(sock.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
    retitle(title)
    _import_then_serve(sock, preload, forked=True)


def as_fresh_interpreter(env: dict[str, str], unbuffered: bool) -> None:
    """Undo in this forked copy what its parent set that an exec would not have carried:
    Python signal handlers (an exec resets them; SIG_IGN survives it, so stays), the
    environment, stdin (the agent starts workers with it closed: /dev/null), and `-u`'s
    unbuffered stdout and stderr where the workers' command has it."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if unbuffered:  # as `python -u` makes them: text over the raw file, written through
        for name in ("stdout", "stderr"):
            old = getattr(sys, name)
            new = io.TextIOWrapper(io.FileIO(old.fileno(), "w", closefd=False),
                                   encoding=old.encoding, errors=old.errors, write_through=True)
            setattr(sys, name, new)
            setattr(sys, f"__{name}__", new)


def _import_then_serve(sock: socket.socket, preload: list[str], forked: bool) -> None:
    started = time.monotonic()
    for name in preload:
        importlib.import_module(name)
    sock.send(json.dumps({"ready": True, "pid": os.getpid(), "forked": forked,
                          "import_s": round(time.monotonic() - started, 3)}).encode())
    job = serve(sock)
    if job is None:
        os._exit(0)
    run(*job)


if __name__ == "__main__":
    main()
