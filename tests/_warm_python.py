"""``python [-W X] -c CODE | -m MODULE | SCRIPT [args]`` in a new process, without paying ``import torch`` each time.

A fresh interpreter spends ~3 s importing torch before it runs a line of the test's code; the tests
that check process-level behaviour (environment variables read at gfxgraph's import, logging set up
at import, exit codes, argv, atexit output) start dozens of them. :func:`run` gives each of them its
own process all the same: a *warm interpreter* -- started with the run's interpreter options and
environment, it has imported torch and nothing of this project -- forks, and the fork does what the
interpreter's start-up would have done from there:

* the working directory, stdin (``/dev/null``), stdout and stderr (files the caller reads back),
  the whole environment of the run (``os.environ``), ``sys.argv`` and ``sys.path[0]`` as
  ``python -c`` / ``python -m`` / ``python SCRIPT`` set them, a new ``__main__`` module;
* the code runs as the interpreter runs it: an uncaught exception prints its traceback and exits
  with 1, ``sys.exit`` exits with its code, and the process ends with a normal interpreter exit
  (``atexit`` handlers, module finalisation, buffered output flushed);
* what torch printed to stderr while it was imported (a warning, say) starts the run's stderr.

The warm interpreter freezes what importing torch made (``gc.freeze``, as interpreters that start
with frozen objects do): a run's collections, and the one at its exit, do not walk it again.

Only ``GFXGRAPH*``/``HGB_*`` variables (and two that no start-up reads, see ``_PER_RUN``) may differ
between the runs one warm interpreter serves: only gfxgraph reads them, at its own import, which happens
after the fork. Besides them:

* ``PYTHONPATH``: the fork takes the ``sys.path`` the run's own start-up makes (asked of a bare
  interpreter started with the run's environment), unless a module the warm interpreter imported would
  not have been found, or found elsewhere, on it: that fork refuses and the run is a plain one;
* ``-W ignore``: the fork adds the filter where the start-up would have put it (behind the filters
  importing torch added), when importing torch warned of nothing.

Any other difference (other interpreter options, ``TORCH_*``, ...) gets a warm interpreter of its own,
started with exactly that environment (in the run's working directory). A run this module cannot serve
(interpreter options other than ``-W``) is a plain ``subprocess.run``; so is every run where
``os.fork`` or ``os.pidfd_open`` is missing.

Tests whose point is what happens *before* the first line of their code -- the ``gfxgraph`` console
script's ``sys.path``, ``import torch`` itself -- keep starting plain interpreters.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict

# Set per run, after the fork: read by gfxgraph only, at its import; pytest's name of the running test and the
# address inductor leaves for its compiled kernels (read when one loads), read by no interpreter's start-up.
# Every other variable is the warm interpreter's own, as its start-up saw it.
_PER_RUN = ("GFXGRAPH", "HGB_", "PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
_MAX_SERVERS = 4  # warm interpreters kept per test process (one per distinct environment), oldest closed first

_SERVER = r'''
import gc, json, os, select, signal, sys, time, types, warnings
_startup_filters = list(warnings.filters)  # the interpreter's own (and -W's): later ones go in front of them
gc.disable()  # importing torch: no full collection over all of it at every growth, one at the end
import torch  # what every run shares
gc.enable()
gc.collect()
gc.freeze()  # torch's objects: no run's collections (nor its exit's) walk them again

def _serve():
    out = sys.stdout
    out.write("@@ready\n")
    out.flush()
    fin = sys.stdin.buffer
    while True:
        line = fin.readline()
        if not line:
            os._exit(0)
        req = json.loads(line)  # {"runs": [...], "timeout": seconds}: the runs start together
        pids = []
        for run in req["runs"]:
            pid = os.fork()
            if pid == 0:
                return run
            pids.append(pid)
        fds = {os.pidfd_open(pid): i for i, pid in enumerate(pids)}
        deadline = time.monotonic() + req["timeout"]
        while fds:
            ready = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))[0]
            if not ready:
                break
            for fd in ready:
                del fds[fd]
                os.close(fd)
        timed_out = [False] * len(pids)
        for fd, i in fds.items():
            os.kill(pids[i], signal.SIGKILL)  # as subprocess.run does on its timeout
            os.close(fd)
            timed_out[i] = True
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        out.write(json.dumps({"returncodes": codes, "timed_out": timed_out}) + "\n")
        out.flush()

req = _serve()
del _serve
# --------------------------------------------------------------- the fork: start-up as python would do it
os.chdir(req["cwd"])
_fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(_fd, 0)
os.close(_fd)
_fd = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(_fd, 1)
os.close(_fd)
if req["stderr"] is None:  # stderr=subprocess.STDOUT
    os.dup2(1, 2)
else:
    _fd = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(_fd, 2)
    os.close(_fd)
sys.stdin = sys.__stdin__ = open(0, encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)
if req["path"] != sys.path[1:]:  # the run's PYTHONPATH makes another sys.path: the one its start-up would make,
    _top = {n for n in sys.modules if "." not in n}  # unless a module imported here would not have been found
    _gone = [os.path.join(p, "") for p in sys.path[1:] if p not in req["path"]]  # (or found elsewhere) there
    _clash = [n for n in _top if (getattr(sys.modules[n], "__file__", None) or "").startswith(tuple(_gone))]
    for _p in req["path"]:
        if _p not in sys.path:
            try:
                _clash += sorted({e.split(".")[0] for e in os.listdir(_p)} & _top)
            except OSError:
                pass
    if _clash:
        os.write(2, b"@@warm_python: refused\n")
        os._exit(97)
    sys.path[1:] = req["path"]
if req["warnoptions"]:  # -W ignore: its filter where the start-up would have put it, behind those added since
    sys.warnoptions[:] = req["warnoptions"]
    _n = len(warnings.filters)
    warnings._processoptions(req["warnoptions"])
    _new = warnings.filters[:len(warnings.filters) - _n]
    del warnings.filters[:len(_new)]
    _at = next((i for i, f in enumerate(warnings.filters) if _startup_filters and f is _startup_filters[0]),
               len(warnings.filters))
    warnings.filters[_at:_at] = _new
    warnings._filters_mutated()
del _startup_filters
os.environ.clear()
os.environ.update(req["env"])
_main = types.ModuleType("__main__")
_main.__builtins__ = __builtins__
sys.modules["__main__"] = _main
_main.__annotations__ = {}
if req["mode"] in ("-c", "script"):
    if req["mode"] == "-c":
        sys.argv = ["-c", *req["args"]]  # sys.path[0] stays "" (the working directory), as for python -c
        _main.__loader__ = __loader__  # what python -c gives __main__ (this program's own)
        _code = compile(req["target"], "<string>", "exec")
    else:
        import importlib.machinery
        sys.argv = [req["target"], *req["args"]]
        sys.path[0] = os.path.dirname(os.path.realpath(req["target"]))  # python SCRIPT: the script's folder
        _main.__file__ = os.path.abspath(req["target"])
        _main.__cached__ = None
        _main.__loader__ = importlib.machinery.SourceFileLoader("__main__", _main.__file__)
        with open(req["target"], "rb") as _f:
            _code = compile(_f.read(), req["target"], "exec")
        del _f
    del req, _fd
    try:
        exec(_code, _main.__dict__)
    except SystemExit:
        raise
    except BaseException as _exc:
        _exc = _exc.with_traceback(_exc.__traceback__.tb_next)  # without this frame: python's own traceback
        sys.excepthook(type(_exc), _exc, _exc.__traceback__)
        sys.exit(1)
else:
    import runpy
    sys.argv = ["-m", *req["args"]]
    sys.path[0] = os.getcwd()  # python -m puts the working directory first
    _module = req["target"]
    del req, _fd
    try:
        runpy._run_module_as_main(_module, alter_argv=True)
    except SystemExit:
        raise
    except BaseException as _exc:
        _exc = _exc.with_traceback(_exc.__traceback__.tb_next)
        sys.excepthook(type(_exc), _exc, _exc.__traceback__)
        sys.exit(1)
'''


class _Server:
    def __init__(self, options: tuple[str, ...], env: dict[str, str], cwd: str, workdir: str) -> None:
        self.workdir = workdir
        err_path = os.path.join(workdir, "server.err")
        with open(err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, *options, "-c", _SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd)
        self.preamble = ""
        first = self._readline(300)
        if first != "@@ready\n":
            self.close()
            raise RuntimeError("the warm interpreter did not start")
        with open(err_path, encoding=locale.getpreferredencoding(False)) as f:
            self.preamble = f.read()  # what importing torch printed: a fresh interpreter would show it too
        self.count = 0
        self.path: tuple[str, ...] = ()  # its sys.path[1:]

    def _readline(self, timeout: float) -> str:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError
        return self.proc.stdout.readline().decode()

    def group(self, runs: list[dict], timeout: float) -> dict:
        """Start ``runs`` together; wait for all, killing what runs past ``timeout`` (one deadline for all)."""
        self.proc.stdin.write((json.dumps({"runs": runs, "timeout": timeout}) + "\n").encode())
        self.proc.stdin.flush()
        return json.loads(self._readline(timeout + 60))

    def run(self, mode: str, target: str, args: list[str], env: dict[str, str], cwd: str, timeout: float,
            path: list[str], warnoptions: list[str]) -> tuple[int | None, str, str]:
        self.count += 1
        out = os.path.join(self.workdir, f"{self.count}.out")
        err = os.path.join(self.workdir, f"{self.count}.err")
        reply = self.group([{"mode": mode, "target": target, "args": args, "env": env, "cwd": cwd, "stdout": out,
                             "stderr": err, "path": path, "warnoptions": warnoptions}], timeout)
        texts = []
        for path in (out, err):
            with open(path, encoding=locale.getpreferredencoding(False)) as f:  # universal newlines, as text=True
                texts.append(f.read())
            os.unlink(path)
        return (None if reply["timed_out"][0] else reply["returncodes"][0]), texts[0], self.preamble + texts[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


_servers: OrderedDict[tuple, _Server] = OrderedDict()
_lock = threading.Lock()
_root: str | None = None


def _close_all() -> None:
    while _servers:
        _servers.popitem(last=False)[1].close()
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)


atexit.register(_close_all)


_paths: dict[tuple, tuple[str, ...]] = {}


def _sys_path(options: tuple[str, ...], env: dict[str, str], cwd: str) -> tuple[str, ...]:
    """``sys.path[1:]`` of ``python OPTIONS -c ...`` started with ``env`` in ``cwd``: where its imports look,
    whatever ``PYTHONPATH`` spelled it with (a duplicate entry, an empty one: the working directory)."""
    entries = env.get("PYTHONPATH", "").split(os.pathsep)
    relative = any(not os.path.isabs(e) for e in entries) if "PYTHONPATH" in env else False
    key = (options, tuple(sorted(env.items())), cwd if relative else None)
    if key not in _paths:
        r = subprocess.run([sys.executable, *options, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                           capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
        _paths[key] = tuple(json.loads(r.stdout.strip().splitlines()[-1])) if r.returncode == 0 else (repr(key),)
    return _paths[key]


def _start(options: tuple[str, ...], base: dict[str, str], cwd: str) -> _Server | None:
    global _root
    key = (options, tuple(sorted((k, v) for k, v in base.items() if k != "PYTHONPATH")))
    server = _servers.get(key)
    if server is not None and server.proc.poll() is None:
        _servers.move_to_end(key)
        return server
    if _root is None:
        _root = tempfile.mkdtemp(prefix="warm_python_")
    try:
        server = _Server(options, base, cwd, tempfile.mkdtemp(dir=_root))
    except (OSError, RuntimeError, TimeoutError):
        return None
    server.path = _sys_path(options, base, cwd)
    _servers[key] = server
    while len(_servers) > _MAX_SERVERS:
        _servers.popitem(last=False)[1].close()
    return server


def _server(options: tuple[str, ...], env: dict[str, str], cwd: str) -> tuple[_Server | None, list[str], list[str]]:
    """The warm interpreter for a run with ``env`` in ``cwd``, the run's ``sys.path[1:]`` and the ``-W`` options
    its fork applies. Runs share one where their start-ups differ only in ``PYTHONPATH`` (the fork takes the
    run's ``sys.path``, unless the modules imported before the fork would not have been found there: then the
    fork refuses, and the run is a plain one) or in ``-W ignore`` (the fork puts the filter where the start-up
    would have, if importing torch warned of nothing)."""
    base = {k: v for k, v in env.items() if not k.startswith(_PER_RUN)}
    path = list(_sys_path(options, base, cwd))
    if options == ("-W", "ignore"):
        plain = _start((), base, cwd)
        if plain is not None and plain.preamble == "":
            return plain, path, ["ignore"]
    return _start(options, base, cwd), path, []


def _parse(argv: list[str], cwd: str) -> tuple[tuple[str, ...], str, str, list[str]] | None:
    """``[-W X]... -c CODE args``, ``... -m MODULE args`` or ``... SCRIPT args`` -> (options, mode, target, args)."""
    options: list[str] = []
    i = 0
    while i + 1 < len(argv) and argv[i] == "-W":
        options += argv[i:i + 2]
        i += 2
    if i + 1 < len(argv) and argv[i] in ("-c", "-m"):
        return tuple(options), argv[i], argv[i + 1], list(argv[i + 2:])
    if i < len(argv) and not argv[i].startswith("-") and os.path.isfile(os.path.join(cwd, argv[i])):
        return tuple(options), "script", argv[i], list(argv[i + 1:])
    return None


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: os.PathLike | str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)``, served by a warm interpreter where it can be (see the module's docstring)."""
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    parsed = _parse(argv, cwd) if hasattr(os, "fork") and hasattr(os, "pidfd_open") else None
    if parsed is not None:
        options, mode, target, args = parsed
        with _lock:
            server, path, warnoptions = _server(options, env, cwd)
            if server is not None:
                rc, out, err = server.run(mode, target, args, env, cwd, timeout, path, warnoptions)
                if rc is None:
                    raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out, err)
                if not (rc == 97 and err.endswith("@@warm_python: refused\n")):
                    return subprocess.CompletedProcess([sys.executable, *argv], rc, out, err)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def run_group(argvs: list[list[str]], *, env: dict[str, str], cwd: os.PathLike | str | None = None,
              outputs: list[os.PathLike | str], timeout: float) -> tuple[list[int], list[bool]]:
    """``python ARGV`` for each of ``argvs``, all started together (the ranks of a process group, say), each
    one's stdout and stderr into its file of ``outputs``; every one still running ``timeout`` seconds after
    the start is killed. Returns (return codes, killed) in the order of ``argvs``."""
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    parsed = [_parse(argv, cwd) for argv in argvs] if hasattr(os, "fork") and hasattr(os, "pidfd_open") else [None]
    if all(p is not None for p in parsed) and len({p[0] for p in parsed}) == 1:
        with _lock:
            server, path, warnoptions = _server(parsed[0][0], env, cwd)
            if server is not None and path == list(server.path) and not warnoptions:  # no fork refuses
                runs = [{"mode": mode, "target": target, "args": args, "env": env, "cwd": cwd, "stdout": os.fspath(out),
                         "stderr": None, "path": path, "warnoptions": []} for (_, mode, target, args), out
                        in zip(parsed, outputs)]
                reply = server.group(runs, timeout)
                if server.preamble:
                    for out in outputs:
                        with open(out, "r+", encoding=locale.getpreferredencoding(False)) as f:
                            text = f.read()
                            f.seek(0)
                            f.write(server.preamble + text)
                return reply["returncodes"], reply["timed_out"]
    files = [open(out, "w") for out in outputs]
    try:
        procs = [subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
                 for argv, f in zip(argvs, files)]
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        killed = [p.poll() is None for p in procs]
        for p, k in zip(procs, killed):
            if k:
                p.kill()
                p.wait()
        return [p.returncode for p in procs], killed
    finally:
        for f in files:
            f.close()
