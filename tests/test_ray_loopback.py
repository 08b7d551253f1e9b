"""The local Ray cluster of a pipeline run listens on loopback only and ends with its driver.

One pipeline run (a tiny RL job, ``rollout.mode='pipeline'``, in a subprocess: the driver)
serves the module. While it trains, every listening socket of its processes (the driver
and everything below it: gcs_server, raylet, agents, workers, the sampler actor) is read
from ``/proc/net/{tcp,tcp6,udp,udp6}`` and mapped to its process through the
``socket:[inode]`` links of ``/proc/<pid>/fd``; any address outside 127.0.0.0/8, ::1 and
::ffff:127.0.0.0/104 fails. Then the driver is SIGKILLed, and every process of the session
must be gone within a bound (Ray's agents alone would linger about 60 s).
"""

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxrl_llm.rollout import reaper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
START_TIMEOUT_S = 480  # the driver's imports, compilation and Ray's start on a loaded 2-core machine
GONE_WITHIN_S = 45  # the reaper needs about a second; Ray's own agents take ~60 s

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc")

DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from tiny_configs import tiny_config
from jaxrl_llm import jobs
c = tiny_config({run_dir!r}, rollout__mode="pipeline", rollout__num_samplers=1, rollout__actor_cpus=0.5,
                rl__steps=100000, sft__steps=0, eval__every=100000, checkpoint__every=100000)
jobs.make_job(c).train()
"""

_TCP_LISTEN, _UDP_UNCONNECTED = "0A", "07"


def _address(hex_addr: str) -> ipaddress._BaseAddress:
  """An address of /proc/net/*: 32-bit words in host byte order."""
  raw = bytes.fromhex(hex_addr)
  words = b"".join(raw[i:i + 4][::-1] if sys.byteorder == "little" else raw[i:i + 4] for i in range(0, len(raw), 4))
  return ipaddress.ip_address(words)


def listening_sockets() -> dict[int, tuple[str, str, int]]:
  """inode -> (protocol, address, port) of every listening TCP and bound, unconnected UDP socket."""
  out = {}
  for proto, state in (("tcp", _TCP_LISTEN), ("tcp6", _TCP_LISTEN), ("udp", _UDP_UNCONNECTED),
                       ("udp6", _UDP_UNCONNECTED)):
    try:
      lines = open(f"/proc/net/{proto}").read().splitlines()[1:]
    except OSError:
      continue
    for line in lines:
      fields = line.split()
      local, st, inode = fields[1], fields[3], int(fields[9])
      if st == state and inode:
        addr, port = local.split(":")
        ip = _address(addr)
        shown = f"::ffff:{ip.ipv4_mapped}" if ip.version == 6 and ip.ipv4_mapped else str(ip)
        out[inode] = (proto, shown, int(port, 16))
  return out


def socket_inodes(pid: int) -> set[int]:
  """Inodes of the sockets ``pid`` holds open."""
  inodes = set()
  try:
    names = os.listdir(f"/proc/{pid}/fd")
  except OSError:
    return inodes
  for fd in names:
    try:
      target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
      continue
    if target.startswith("socket:["):
      inodes.add(int(target[len("socket:["):-1]))
  return inodes


def process_name(pid: int) -> str:
  """The program's name (``python <script>`` for a Python script; Ray's title for its workers)."""
  try:
    argv = [a.decode(errors="replace") for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if a]
  except OSError:
    return "?"
  if not argv:
    return "?"
  name = os.path.basename(argv[0].split(" ")[0])
  script = next((os.path.basename(a) for a in argv[1:] if a.endswith(".py")), "")
  return f"{name} {script}" if name.startswith("python") and script else name


def is_loopback(address: str) -> bool:
  ip = ipaddress.ip_address(address)
  if ip.version == 6 and ip.ipv4_mapped is not None:
    ip = ip.ipv4_mapped
  return ip.is_loopback


def session(driver_pid: int) -> dict[int, str]:
  """pid -> name of the driver and every process below it."""
  return {pid: process_name(pid) for pid in [driver_pid, *reaper.descendants([driver_pid])]}


def session_sockets(driver_pid: int) -> list[tuple[str, int, str, str, int]]:
  """(name, pid, protocol, address, port) of every listening socket of the session."""
  sockets = listening_sockets()
  out = []
  for pid, name in session(driver_pid).items():
    for inode in socket_inodes(pid) & set(sockets):
      out.append((name, pid, *sockets[inode]))
  return out


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
  """The driver, once its pipeline has finished an RL step (so the sampler actor is serving)."""
  pytest.importorskip("ray")
  folder = tmp_path_factory.mktemp("loopback")
  run_dir = folder / "run"
  script = folder / "driver.py"
  script.write_text(DRIVER.format(tests=TESTS, run_dir=str(run_dir)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  log = open(folder / "driver.log", "w")
  proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  metrics = run_dir / "metrics.jsonl"
  deadline = time.monotonic() + START_TIMEOUT_S
  started = False
  while time.monotonic() < deadline and proc.poll() is None and not started:
    time.sleep(1.0)
    if metrics.exists():
      started = any("pool/dispatched" in json.loads(line) for line in metrics.read_text().splitlines()
                    if line.strip().endswith("}"))
  if not started:
    proc.kill()
    proc.wait()
    pytest.fail(f"the pipeline run did not reach an RL step in {START_TIMEOUT_S} s (exit {proc.returncode}):\n"
                + (folder / "driver.log").read_text()[-4000:])
  known = {reaper.identity(p) for p in session(proc.pid)} - {None}
  yield proc, known
  if proc.poll() is None:
    proc.kill()
  proc.wait()
  for ident in known:  # whatever the test left behind (only processes of this run)
    if reaper.alive(ident):
      os.kill(int(ident.split(":")[0]), signal.SIGKILL)
  log.close()


def test_every_listening_socket_of_a_pipeline_run_is_on_loopback(pipeline_run):
  proc, _ = pipeline_run
  by_socket = {}
  for _ in range(3):  # a few looks: processes that start a listener a moment later are seen too
    for name, pid, proto, addr, port in session_sockets(proc.pid):
      by_socket.setdefault((pid, proto, addr, port), name)  # an actor's title changes with its current call
    time.sleep(1.0)
  seen = {(name, *key) for key, name in by_socket.items()}
  listing = "\n".join(f"  {name} (pid {pid}) {proto} {addr}:{port}" for name, pid, proto, addr, port in sorted(seen))
  print(f"listening sockets of the pipeline run:\n{listing}")
  names = {name for name, *_ in seen}
  # not vacuous: the head processes, the driver and the sampler actor were all seen listening
  assert {"gcs_server", "raylet"} <= names, listing
  assert any(pid == proc.pid for _, pid, *_ in seen), f"the driver's own gRPC server is missing:\n{listing}"
  assert any(name.startswith("ray::SamplerWorker") for name in names), listing
  exposed = [s for s in seen if not is_loopback(s[3])]
  assert not exposed, f"listening beyond loopback:\n{listing}"


def test_the_session_ends_when_the_driver_is_killed(pipeline_run):
  proc, known = pipeline_run
  assert proc.poll() is None, "the driver ended on its own"
  everything = known | ({reaper.identity(p) for p in session(proc.pid)} - {None})
  names = {ident: process_name(int(ident.split(":")[0])) for ident in everything}
  assert any(n.startswith("ray::SamplerWorker") for n in names.values()) and "raylet" in names.values(), names
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  deadline = time.monotonic() + GONE_WITHIN_S
  left = everything
  while left and time.monotonic() < deadline:
    time.sleep(0.5)
    left = {i for i in left if reaper.alive(i)}
  assert not left, (f"{GONE_WITHIN_S} s after the driver's SIGKILL these are still running: "
                    f"{sorted(names[i] for i in left)}")


def test_the_local_cluster_is_started_on_loopback_in_process():
  """``ensure_ray`` in this process: the node IP Ray reports is 127.0.0.1."""
  ray = pytest.importorskip("ray")
  from jaxrl_llm.rollout import ensure_ray
  was = ray.is_initialized()
  ensure_ray(num_cpus=1)
  try:
    if not was:
      assert ray.util.get_node_ip_address() == "127.0.0.1"
      assert socket.inet_aton(ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]) == socket.inet_aton("127.0.0.1")
  finally:
    if not was:
      ray.shutdown()
