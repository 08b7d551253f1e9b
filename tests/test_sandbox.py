"""Security and behaviour of the bubblewrap sandbox (jaxrl_llm.tasks.sandbox).

Each security test fails if the sandbox leaks: the code's output is checked for the secret or
the effect it was after, and the host is checked afterwards (files not written, processes gone,
the test process alive, the pool still serving). Assertions are on statuses and effects, never on
durations. Skipped only where bwrap cannot isolate at all (``isolation_available()`` says why);
``Sandbox`` then raises instead of running anything.
"""

import os
import pathlib
import secrets
import shutil
import socket
import sys
import tempfile
import time

import pytest

from jaxrl_llm.tasks import sandbox as S
from jaxrl_llm.tasks import sandbox_child

AVAILABLE, WHY = S.isolation_available()
needs_sandbox = pytest.mark.skipif(not AVAILABLE, reason=f"no isolation here: {WHY}")
FAST = S.SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_mb=256, max_processes=8, output_bytes=4096)


@pytest.fixture(scope="module")
def box():
  if not AVAILABLE:
    pytest.skip(f"no isolation here: {WHY}")
  with S.Sandbox(workers=2, limits=FAST) as sandbox:
    yield sandbox


def _alive(box):
  result = box.run("print(6 * 7)")
  assert result.ok and result.stdout == "42\n", result


@pytest.fixture
def open_dir():
  """A folder on the host that anyone may read and write (pytest's tmp_path is 0700, which would hide a
  leaky mount from the sandbox's unprivileged uid and let these tests pass for the wrong reason)."""
  path = tempfile.mkdtemp(prefix="jaxrl-sandbox-test-")
  os.chmod(path, 0o777)
  yield pathlib.Path(path)
  shutil.rmtree(path, ignore_errors=True)


def _world(path, mode):
  os.chmod(path, mode)
  return path


def _no_leak(result, secret):
  assert secret not in result.stdout and secret not in result.stderr, result


# ---------------------------------------------------------------- network

@needs_sandbox
def test_loopback_socket_cannot_reach_the_host(box):
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  listener.setblocking(False)
  port = listener.getsockname()[1]
  try:
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'LEAK')\nprint('CONNECTED')")
    result = box.run(code)
    assert result.status == "error" and "CONNECTED" not in result.stdout, result
    assert "ConnectionRefused" in result.cause or "unreachable" in result.cause, result
    with pytest.raises(BlockingIOError):  # nothing ever connected to the host's listener
      listener.accept()
  finally:
    listener.close()
  _alive(box)


@needs_sandbox
def test_outside_addresses_are_unreachable(box):
  for host, port in [("1.1.1.1", 80), ("8.8.8.8", 53), ("10.0.0.1", 22)]:
    code = f"import socket\nsocket.create_connection(('{host}', {port}), timeout=2)\nprint('CONNECTED')"
    result = box.run(code)
    assert result.status == "error" and "CONNECTED" not in result.stdout, result
    assert "unreachable" in result.cause.lower(), result
  dns = box.run("import socket\nprint('RESOLVED', socket.gethostbyname('example.com'))")
  assert dns.status == "error" and "RESOLVED" not in dns.stdout, dns


# ---------------------------------------------------------------- files

_READ = """
import os, sys
for p in sys.argv_paths:
    try:
        if os.path.isdir(p):
            print('LIST', p, sorted(os.listdir(p)))
        else:
            print('READ', p, open(p).read())
    except OSError as e:
        print('DENIED', p, type(e).__name__)
"""


def _reader(paths):
  return _READ.replace("sys.argv_paths", repr(list(paths)))


@needs_sandbox
def test_run_folder_secrets_and_home_are_not_readable(box, open_dir):
  secret = "SECRET-" + secrets.token_hex(8)
  run = open_dir / "run"
  run.mkdir()
  _world(run, 0o755)
  (run / "secret.txt").write_text(secret)
  _world(run / "secret.txt", 0o644)
  home = open_dir / "home"
  home.mkdir()
  _world(home, 0o755)
  (home / ".netrc").write_text(secret)
  _world(home / ".netrc", 0o644)
  parent_home = os.path.expanduser("~")
  paths = [str(run / "secret.txt"), str(run), str(home / ".netrc"), str(home), "/etc/shadow", "/etc/passwd",
           os.path.join(parent_home, ".bash_history"), os.path.join(parent_home, ".ssh"), os.getcwd(),
           os.path.join(os.getcwd(), "pyproject.toml"), "/work"]
  result = box.run(_reader(paths))
  assert result.ok, result
  _no_leak(result, secret)
  for p in paths:  # each path is refused or absent
    assert f"DENIED {p} " in result.stdout, (p, result.stdout)
  if os.access("/etc/shadow", os.R_OK):
    first = open("/etc/shadow").readline().strip()
    if first:
      _no_leak(result, first)
  # The parent's home shows at most the folders leading to the interpreter (mounted read-only).
  listing = box.run(f"import os\nprint(sorted(os.listdir({parent_home!r})) if os.path.isdir({parent_home!r}) else [])")
  assert listing.ok, listing
  allowed = set()
  for prefix in {sys.base_prefix, sys.prefix}:
    if prefix.startswith(parent_home.rstrip("/") + "/"):
      allowed.add(os.path.relpath(prefix, parent_home).split(os.sep)[0])
  assert set(eval(listing.stdout)) <= allowed, listing  # pylint: disable=eval-used
  env = box.run("import os\nprint(sorted(os.environ))")
  assert env.ok and "JAXRL" not in env.stdout and "PYTHONPATH" not in env.stdout, env


@needs_sandbox
def test_writes_outside_scratch_do_not_reach_the_host(box, open_dir):
  token = secrets.token_hex(8)
  run = open_dir / "run"
  run.mkdir()
  _world(run, 0o777)
  targets = [str(run / f"evil-{token}"), f"/usr/evil-{token}", f"/tmp/evil-{token}", f"/etc/evil-{token}",
             os.path.join(os.path.expanduser("~"), f"evil-{token}"), os.path.join(os.getcwd(), f"evil-{token}"),
             f"/dev/shm/evil-{token}"]
  code = ("import os\n"
          f"for p in {targets!r}:\n"
          "    try:\n"
          "        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
          "        open(p, 'w').write('x')\n"
          "        print('WROTE', p)\n"
          "    except OSError as e:\n"
          "        print('DENIED', p, type(e).__name__)\n"
          "open('scratch.txt', 'w').write('ok')\nprint('SCRATCH', open('scratch.txt').read())")
  result = box.run(code)
  assert result.ok and "SCRATCH ok" in result.stdout, result
  for p in targets:
    assert not os.path.exists(p), p
  assert "WROTE" not in result.stdout, result.stdout


@needs_sandbox
def test_each_call_gets_a_fresh_process_and_scratch(box):
  first = box.run("import builtins, os\nbuiltins.POISON = 1\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
  assert first.ok, first
  for _ in range(4):  # whichever worker serves it
    again = box.run("import builtins, os\nprint(hasattr(builtins, 'POISON'), os.listdir('.'))")
    assert again.ok and again.stdout.strip() == "False []", again


# ---------------------------------------------------------------- resources

def _host_processes() -> int:
  return sum(1 for d in os.listdir("/proc") if d.isdigit())


@needs_sandbox
def test_fork_bomb_is_bounded_and_cleaned_up(box):
  before = _host_processes()
  counted = box.run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                    "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
                    "except OSError as e:\n    print('FORKS', n, e.errno)")
  assert counted.ok and counted.stdout.startswith("FORKS"), counted
  assert int(counted.stdout.split()[1]) < FAST.max_processes, counted
  bomb = box.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
  assert bomb.status in ("timeout", "cpu", "killed") and bomb.cause, bomb
  deadline = time.monotonic() + 30
  while _host_processes() > before + 8 and time.monotonic() < deadline:
    time.sleep(0.2)
  assert _host_processes() <= before + 8, (before, _host_processes())
  _alive(box)


@needs_sandbox
def test_ten_gib_allocation_is_a_memory_error(box):
  result = box.run("x = bytearray(10 * 1024 ** 3)\nprint('ALLOCATED')")
  assert result.status == "memory" and "MemoryError" in result.cause and "ALLOCATED" not in result.stdout, result
  _alive(box)


@needs_sandbox
def test_infinite_loops_hit_the_cpu_or_wall_limit(box):
  spin = box.run("while True:\n    pass")
  assert spin.status in ("cpu", "timeout") and spin.cause, spin
  sleeper = box.run("import time\nwhile True:\n    time.sleep(1)", limits=FAST.__class__(wall_seconds=1.5))
  assert sleeper.status == "timeout" and "wall-clock" in sleeper.cause, sleeper
  _alive(box)


@needs_sandbox
def test_printing_a_gigabyte_is_cut_at_the_output_limit(box):
  result = box.run("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)")
  assert result.status == "output_limit" and "output limit" in result.cause, result
  assert len(result.stdout) + len(result.stderr) <= FAST.output_bytes, len(result.stdout)
  big = box.run("print('y' * 10 ** 9)")  # one 1 GB string: over the address space first
  assert big.status in ("memory", "output_limit") and len(big.stdout) <= FAST.output_bytes, big.status
  _alive(box)


@needs_sandbox
def test_killing_the_parent_init_or_host_is_contained(box):
  me = os.getpid()
  for code in ["import os\nos.kill(os.getppid(), 9)", "import os\nos.kill(1, 9)\nprint('after init')",
               f"import os\nos.kill({me}, 9)", f"import os\nos.killpg({me}, 9)", "import os\nos.kill(-1, 9)",
               "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)"]:
    result = box.run(code)
    assert result.status in ("error", "killed", "ok"), result
    if result.status != "ok":
      assert result.cause, result
    _alive(box)  # the next call is served (a killed worker is replaced)
  os.kill(me, 0)  # this process is alive


@needs_sandbox
def test_metrics_count_calls_and_kills(box):
  box.metrics()
  results = box.run_many(["print(1)", "raise ValueError('boom')", "x = bytearray(10 * 1024 ** 3)"])
  assert [r.status for r in results] == ["ok", "error", "memory"]
  assert results[1].cause == "ValueError: boom"
  m = box.metrics()
  assert m["sandbox/calls"] == 3 and m["sandbox/kills_memory"] == 1 and "sandbox/kills_error" not in m
  assert box.metrics()["sandbox/calls"] == 0
  assert box.run("print(input()[::-1])", stdin="abc").stdout == "cba\n"


# ---------------------------------------------------------------- no silent downgrade

def test_missing_bwrap_raises_and_runs_nothing(monkeypatch, tmp_path):
  monkeypatch.setenv(S.BWRAP_ENV, "/nonexistent/bwrap")
  ok, why = S.isolation_available()
  assert not ok and "/nonexistent/bwrap" in why and "bubblewrap" in why
  with pytest.raises(S.SandboxUnavailable, match="nonexistent"):
    S.Sandbox(workers=1)
  fake = tmp_path / "bwrap"
  fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv(S.BWRAP_ENV, str(fake))
  with pytest.raises(S.SandboxUnavailable, match="No permissions to create new namespace"):
    S.Sandbox(workers=1)


def test_the_snippet_runner_refuses_to_run_outside_the_sandbox(tmp_path):
  marker = tmp_path / "ran"
  with pytest.raises(RuntimeError, match="only inside the bwrap sandbox"):
    sandbox_child.run_snippet(f"open({str(marker)!r}, 'w')", "", vars(S.SandboxLimits()), False)
  assert not marker.exists()
