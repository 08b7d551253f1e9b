"""The code that runs *inside* the sandbox: one snippet per call, each in a fresh forked process.

:class:`jaxrl_llm.tasks.sandbox.Sandbox` starts a :class:`jaxrl_llm.tasks.workers.WorkerPool`
whose workers run behind bubblewrap (``bwrap ... -- python -m jaxrl_llm.tasks.worker_main``) and
whose function is :func:`run_snippet`. This module imports only the standard library: inside the
sandbox only the Python standard library and the four package modules the worker needs are
mounted (see ``sandbox.bwrap_argv``).

Per call (``run_snippet(code, stdin, limits, privileged)``), the warm worker:

1. makes a fresh scratch folder ``/tmp/call-<n>`` on the sandbox's size-limited tmpfs;
2. forks a child, which starts a new session, takes ``stdin`` from a memfd and pipes as
   stdout/stderr, closes every other descriptor (the worker's protocol pipes included), sets
   ``RLIMIT_AS``/``CPU``/``FSIZE``/``NPROC``/``NOFILE``/``CORE`` and, when the worker runs as
   root (``privileged``), drops to a fresh unprivileged uid/gid of its own (so the kernel
   enforces ``RLIMIT_NPROC``, which it never does for uid 0, and the child cannot signal the
   worker), then ``exec``\\s the code as ``__main__`` in a clean namespace;
3. reads at most ``output_bytes`` of output, kills the child's session on the wall-clock
   deadline or on more output, and afterwards kills every process left in the sandbox's PID
   namespace (``kill(-1, SIGKILL)``) and removes the scratch folder, so one snippet cannot
   poison the next.

The reply is a plain tuple ``(status, exit_code, stdout, stderr, seconds, cause)`` with the
statuses of :class:`jaxrl_llm.tasks.sandbox.SandboxResult`.
"""

import os
import random
import resource
import select
import shutil
import signal
import sys
import time
import traceback

__all__ = ["run_snippet", "MEMORY_EXIT", "INSIDE_ENV"]

INSIDE_ENV = "JAXRL_SANDBOX_INSIDE"  # set by bwrap (--setenv); run_snippet refuses to run without it
MEMORY_EXIT = 213  # the child's exit code for a MemoryError
_UID_BASE, _UID_SPAN = 1_000_000_000, 1 << 29  # fresh uids for the calls of a privileged worker
_calls = 0


def _limit(which: int, value: int, slack: int = 0) -> None:
  """Sets the soft limit to ``value`` and the hard one to ``value + slack`` (within the current hard limit)."""
  hard = resource.getrlimit(which)[1]
  soft, new_hard = int(value), int(value) + slack
  if hard >= 0:
    soft, new_hard = min(soft, hard), min(new_hard, hard)
  resource.setrlimit(which, (soft, new_hard))


def _child(code: str, stdin_fd: int, out_w: int, err_w: int, scratch: str, limits: dict, uid: int) -> None:
  """In the forked child: isolate, limit, run ``code``; never returns."""
  status = 1
  try:
    os.setsid()
    for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, signal.SIG_DFL)
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 1 << 16)
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                                       buffering=1)
    os.chdir(scratch)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"})
    sys.path[:] = [scratch] + [p for p in sys.path if p and "jaxrl" not in p]
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 256)
    _limit(resource.RLIMIT_FSIZE, int(limits["file_size_mb"]) << 20)
    _limit(resource.RLIMIT_CPU, max(1, int(-(-float(limits["cpu_seconds"]) // 1))), slack=1)  # SIGXCPU, then SIGKILL
    _limit(resource.RLIMIT_AS, int(limits["memory_mb"]) << 20)
    # The child itself plus, without a fresh uid, the worker and bwrap's init of this PID namespace.
    _limit(resource.RLIMIT_NPROC, int(limits["max_processes"]) + (0 if uid else 3))
    if uid:
      os.setgroups([])
      os.setresgid(uid, uid, uid)
      os.setresuid(uid, uid, uid)  # leaves no capabilities
    compiled = compile(code, "<sandbox>", "exec")
    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})  # pylint: disable=exec-used
    status = 0
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if e.code is not None and not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
  except MemoryError:
    status = MEMORY_EXIT
    try:
      sys.stderr.write("MemoryError\n")
    except BaseException:  # pylint: disable=broad-except
      pass
  except BaseException as e:  # pylint: disable=broad-except
    try:  # without this module's frame
      traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
    except BaseException:  # pylint: disable=broad-except
      pass
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except BaseException:  # pylint: disable=broad-except
        pass
    os._exit(status & 0xFF)  # pylint: disable=protected-access


def _read_output(pid: int, out_r: int, err_r: int, limits: dict, started: float):
  """Collects the child's output until it exits; returns ``(out, err, wait_status, verdict)``."""
  budget = int(limits["output_bytes"])
  deadline = started + float(limits["wall_seconds"])
  pidfd = os.pidfd_open(pid)
  poller = select.poll()
  for fd in (out_r, err_r, pidfd):
    poller.register(fd, select.POLLIN)
  chunks = {out_r: bytearray(), err_r: bytearray()}
  kept, verdict, open_fds, exited = 0, None, {out_r, err_r}, False

  def keep(fd: int, data: bytes) -> bool:
    """Keeps what fits of ``data`` in the output budget; False when some of it did not fit."""
    nonlocal kept
    take = data[:max(0, budget - kept)]
    chunks[fd] += take
    kept += len(take)
    return len(take) == len(data)
  while not exited and verdict is None:
    left = deadline - time.monotonic()
    if left <= 0:
      verdict = "timeout"
      break
    for fd, _ in poller.poll(left * 1000):
      if fd == pidfd:
        exited = True
        continue
      data = os.read(fd, 1 << 16)
      if not data:
        poller.unregister(fd)
        open_fds.discard(fd)
        continue
      if not keep(fd, data):
        verdict = "output_limit"
        break
  if verdict is None:  # the child exited: what it wrote before is in the pipes
    for fd in list(open_fds):
      os.set_blocking(fd, False)
      try:
        while kept <= budget:
          data = os.read(fd, 1 << 16)
          if not data:
            break
          if not keep(fd, data):
            verdict = "output_limit"
            break
      except BlockingIOError:
        pass
  if verdict is not None:
    try:
      os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      os.kill(pid, signal.SIGKILL)
  _, wait_status = os.waitpid(pid, 0)
  os.close(pidfd)
  return bytes(chunks[out_r]), bytes(chunks[err_r]), wait_status, verdict


def _classify(wait_status: int, verdict, err: str, limits: dict):
  """``(status, exit_code, cause)`` of a finished child."""
  if verdict == "timeout":
    return "timeout", None, f"wall-clock limit {float(limits['wall_seconds']):g} s"
  if verdict == "output_limit":
    return "output_limit", None, f"output limit {int(limits['output_bytes'])} bytes (stdout+stderr); killed"
  if os.WIFSIGNALED(wait_status):
    sig = os.WTERMSIG(wait_status)
    try:
      name = signal.Signals(sig).name
    except ValueError:
      name = f"signal {sig}"
    if sig == signal.SIGXCPU:
      return "cpu", -sig, f"CPU-time limit {float(limits['cpu_seconds']):g} s (SIGXCPU)"
    return "killed", -sig, f"killed by signal {sig} ({name})"
  code = os.WEXITSTATUS(wait_status)
  if code == 0:
    return "ok", 0, ""
  if code == MEMORY_EXIT:
    return "memory", code, f"MemoryError (address-space limit {int(limits['memory_mb'])} MiB)"
  lines = [l for l in err.strip().splitlines() if l.strip()]
  return "error", code, (lines[-1].strip()[:300] if lines else f"exit code {code}")


def _sweep(scratch: str) -> None:
  """Kills every process left in this PID namespace but the worker and init; removes the scratch."""
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    pass

  def unlock(func, path, _):
    try:
      os.chmod(os.path.dirname(path), 0o700)
      os.chmod(path, 0o700)
      func(path)
    except OSError:
      pass

  shutil.rmtree(scratch, onerror=unlock)


def run_snippet(code: str, stdin: str, limits: dict, privileged: bool) -> tuple:
  """Runs ``code`` in a fresh child process of this (sandboxed) worker; see the module docstring.

  Args:
    code: Python source, run as ``__main__``.
    stdin: text the child reads on its standard input.
    limits: the fields of :class:`jaxrl_llm.tasks.sandbox.SandboxLimits` as a dict.
    privileged: the worker runs as root inside the sandbox (bwrap started by root): the child
      switches to a fresh unprivileged uid.

  Returns:
    ``(status, exit_code, stdout, stderr, seconds, cause)``.

  Raises:
    RuntimeError: when not inside a sandbox started by :class:`~jaxrl_llm.tasks.sandbox.Sandbox`
      (the function never runs code unsandboxed).
  """
  global _calls
  if os.environ.get(INSIDE_ENV) != "1" or os.getpid() > 16:
    raise RuntimeError("run_snippet runs only inside the bwrap sandbox of jaxrl_llm.tasks.sandbox.Sandbox")
  _calls += 1
  scratch = f"/tmp/call-{_calls}"
  os.mkdir(scratch, 0o700)
  uid = _UID_BASE + random.randrange(_UID_SPAN) if privileged else 0
  if uid:
    os.chown(scratch, uid, uid)
  stdin_fd = os.memfd_create("stdin")
  os.write(stdin_fd, stdin.encode("utf-8"))
  os.lseek(stdin_fd, 0, os.SEEK_SET)
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  started = time.monotonic()
  pid = os.fork()
  if pid == 0:
    _child(code, stdin_fd, out_w, err_w, scratch, limits, uid)
  for fd in (stdin_fd, out_w, err_w):
    os.close(fd)
  try:
    out, err, wait_status, verdict = _read_output(pid, out_r, err_r, limits, started)
  finally:
    os.close(out_r)
    os.close(err_r)
    seconds = time.monotonic() - started
    _sweep(scratch)
  stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
  status, exit_code, cause = _classify(wait_status, verdict, stderr, limits)
  return status, exit_code, stdout, stderr, seconds, cause
