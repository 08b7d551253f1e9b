"""Starting or joining the Ray cluster the sampler actors run on."""

from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger("jaxrl_llm")


def ensure_ray(address: Optional[str] = None, num_cpus: Optional[int] = None) -> None:
  """Connects to Ray once per process.

  Args:
    address: a cluster address (``"ray://host:10001"``, ``"host:6379"`` or
      ``"auto"``) to join an existing cluster; empty or None starts a private
      local cluster bound to loopback (127.0.0.1), with no dashboard.
    num_cpus: CPUs the local cluster advertises (default: the machine's).

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
  ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
           _node_ip_address="127.0.0.1", log_to_driver=True, runtime_env={"env_vars": env},
           configure_logging=False)
  log.info("started a local Ray cluster on 127.0.0.1")
