"""Starting or joining the Ray cluster the sampler actors run on, confined to loopback.

Without ``rollout.address``, :func:`ensure_ray` starts a private single-node cluster that
listens on 127.0.0.1 only (Ray 2.x, measured with ``ss -ltnp`` and
``tests/test_ray_loopback.py``):

* Node IP 127.0.0.1. Ray's ``ray.init(_node_ip_address="127.0.0.1")`` alone does not give
  it: ``services.resolve_ip_for_localhost`` turns a loopback address into the host's
  external one unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off (its switch is the
  variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``; off, Ray uses loopback as on macOS and
  Windows). With the constant off while the cluster starts, the node IP is 127.0.0.1, and
  then every server binds it: gcs_server, raylet (node manager and object manager), the
  core-worker gRPC servers of the driver, workers and actors (``::ffff:127.0.0.1`` on a
  dual-stack socket), the runtime-env agent, the dashboard agent's gRPC and metrics
  ports, and the autoscaler monitor's Prometheus endpoint (``addr=127.0.0.1`` once the
  GCS address is loopback). The dashboard is off (``include_dashboard=False``; its
  head process, when Ray starts one anyway, binds ``dashboard_host=127.0.0.1``).
* Lifetime. Ray ties gcs_server, raylet and the other head processes to the driver
  (``PR_SET_PDEATHSIG``) and workers exit when their raylet dies, but the dashboard and
  runtime-env agents wait ~60 s on the dead GCS first. A reaper process
  (:mod:`jaxrl_llm.rollout.reaper`) SIGKILLs what remains of the session within about a
  second of the driver's death; and each sampler actor runs a watchdog
  (:func:`watch_driver`) that ends its process when the driver is gone.

With ``rollout.address`` (``"host:6379"``, ``"ray://host:10001"``, ``"auto"``) the driver
joins that cluster as it is configured: binding is then the cluster's business, and Ray
ends a job's actors when its driver disconnects.
"""

from __future__ import annotations

import logging
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from jaxrl_llm.rollout import reaper

log = logging.getLogger("jaxrl_llm")

LOOPBACK = "127.0.0.1"
DRIVER_ENV = "JAXRL_LLM_DRIVER"  # "<boot id>/<pid namespace>/<pid>:<start ticks>" of the driver, for actor watchdogs
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ensure_ray(address: Optional[str] = None, num_cpus: Optional[int] = None,
               gpu_ids: Optional[Sequence[str]] = None) -> None:
  """Connects to Ray once per process.

  Args:
    address: a cluster address (``"ray://host:10001"``, ``"host:6379"`` or
      ``"auto"``) to join an existing cluster; empty or None starts a private
      local cluster bound to loopback (127.0.0.1), with no dashboard, whose
      processes end when this one does (see the module docstring).
    num_cpus: CPUs the local cluster advertises (default: the machine's).
    gpu_ids: the GPUs a local cluster declares and hands to actors that ask for GPUs
      (``CUDA_VISIBLE_DEVICES`` of its raylet while it starts; Ray gives an actor only
      ids from this list). None or empty: no GPUs (Ray's own detection is not used, so
      the learner's GPUs are never declared).

  Raises:
    ConnectionError: naming the address when a given cluster cannot be joined.
  """
  import ray

  if ray.is_initialized():
    return
  if address:
    try:
      ray.init(address=address, log_to_driver=True)
    except Exception as e:  # ray raises several types for an unreachable head
      raise ConnectionError(f"rollout.address={address!r}: could not join the Ray cluster ({e})") from e
    return
  # Actors inherit the driver's environment (JAX flags, PYTHONPATH of an editable install).
  env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "PYTHON"))}
  me = driver_identity()
  if me:
    env[DRIVER_ENV] = me
  before = set(_children())
  gpu_ids = [str(g) for g in gpu_ids or ()]
  with _loopback_only(), _environ("CUDA_VISIBLE_DEVICES", ",".join(gpu_ids)):
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), num_gpus=len(gpu_ids), include_dashboard=False,
             dashboard_host=LOOPBACK, _node_ip_address=LOOPBACK, log_to_driver=True,
             runtime_env={"env_vars": env}, configure_logging=False)
  node_ip = ray.util.get_node_ip_address()
  if node_ip != LOOPBACK:
    log.warning("the local Ray cluster runs on %s, not %s: its ports may be reachable from other hosts",
                node_ip, LOOPBACK)
  _start_reaper(me, sorted(set(_children()) - before))
  log.info("started a local Ray cluster on %s", node_ip)


@contextlib.contextmanager
def _loopback_only():
  """While a local cluster starts: Ray's loopback switch off (constant and variable, for the children)."""
  from ray._private import ray_constants  # pylint: disable=import-outside-toplevel
  flag = ray_constants.ENABLE_RAY_CLUSTER
  ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time by services.get_node_ip_address
  try:
    with _environ(_LOOPBACK_SWITCH, "0"):
      yield
  finally:
    ray_constants.ENABLE_RAY_CLUSTER = flag


@contextlib.contextmanager
def _environ(name: str, value: str):
  """``os.environ[name] = value`` for the block (then as it was, unset included)."""
  saved = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if saved is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = saved


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now (a rendezvous to hand out)."""
  with socket.socket() as s:
    s.bind((LOOPBACK, 0))
    return int(s.getsockname()[1])


# ---------------------------------------------------------------------- lifetime

def _read(path: str) -> str:
  try:
    with open(path, encoding="ascii") as f:
      return f.read().strip()
  except OSError:
    return ""


def _machine() -> str:
  """``"<boot id>/<pid namespace>"``: pids compare only between processes that share both."""
  if not os.path.isdir("/proc"):
    return ""
  try:
    namespace = os.readlink("/proc/self/ns/pid")
  except OSError:
    namespace = ""
  boot = _read("/proc/sys/kernel/random/boot_id")
  return f"{boot}/{namespace}" if boot and namespace else ""


def driver_identity(pid: Optional[int] = None) -> str:
  """``"<boot id>/<pid namespace>/<pid>:<start ticks>"`` of this (or ``pid``'s) process; "" off Linux."""
  machine = _machine()
  ident = reaper.identity(pid or os.getpid()) if machine else None
  return f"{machine}/{ident}" if ident else ""


def _children() -> list[int]:
  if not os.path.isdir("/proc"):
    return []
  return reaper.children_map().get(os.getpid(), [])


def _start_reaper(me: str, heads: list[int]) -> None:
  """Starts the reaper of the cluster just started (its head processes: ``heads``)."""
  idents = [i for i in (reaper.identity(p) for p in heads) if i]
  if not me or not idents:
    return
  subprocess.Popen([sys.executable, "-S", reaper.__file__, me.rsplit("/", 1)[1], *idents],
                   stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def watch_driver(poll_s: float = 1.0) -> bool:
  """In a sampler actor: ends this process when the driver that started the local cluster is gone.

  A daemon thread polls the driver's identity (``JAXRL_LLM_DRIVER``, set by
  :func:`ensure_ray`) every ``poll_s`` seconds. Nothing happens when the variable is
  unset (a joined cluster: Ray ends a dead driver's actors) or names a process of another
  machine or pid namespace.

  Returns:
    Whether a watchdog was started.
  """
  value = os.environ.get(DRIVER_ENV, "")
  machine, _, ident = value.rpartition("/")
  if not ident or not machine or machine != _machine():
    return False

  def run():
    while reaper.alive(ident):
      time.sleep(poll_s)
    log.warning("the driver (pid %s) is gone: this sampler actor exits", ident.split(":")[0])
    os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=run, name="driver-watchdog", daemon=True).start()
  return True
