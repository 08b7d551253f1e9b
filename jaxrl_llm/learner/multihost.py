"""Multi-process (multi-host) learner: start-up and host transfers.

A multi-host learner is N copies of the same program, one JAX process per
host, joined by ``jax.distributed.initialize``; ``jax.devices()`` then lists
the devices of every process and the learner mesh spans them all. Every
process runs the whole loop (sampling, scoring, batching) on identical host
data: sampling keys are functions of (seed, step), so the processes agree
without exchanging trajectories; only the learner's arrays are global.

Three things differ from one process, and live here:

* start-up: :func:`initialize` reads the coordinator address, process count
  and process id from arguments or the environment (``JAXRL_COORDINATOR``,
  ``JAXRL_NUM_PROCESSES``, ``JAXRL_PROCESS_ID``) and selects gloo CPU
  collectives, so N processes on one machine (``launch/local_multihost.py``)
  or on several CPU hosts communicate over TCP;
* host transfers: an array sharded over devices of other processes is not
  *fully addressable*, so ``np.asarray`` cannot read it. :func:`to_host`
  gathers such arrays with ``process_allgather`` (a collective: every process
  must call it at the same point) and :func:`local_copy` puts the whole value
  on one local device (what the in-process sampler reads).

Host data that every process holds identically (batches, replicated
scalars) can be passed to jitted functions on the global mesh as it is: JAX
treats such process-local inputs of a multi-process ``jit`` as replicated.

Only process 0 writes the run's files (:func:`is_main_process`); orbax
coordinates checkpoint writes itself.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV_COORDINATOR = "JAXRL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"

_initialized = False


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, initialization_timeout: int = 120) -> bool:
  """Joins a multi-process JAX job when one is configured; a no-op otherwise.

  Arguments left as None are read from ``JAXRL_COORDINATOR``,
  ``JAXRL_NUM_PROCESSES`` and ``JAXRL_PROCESS_ID``. With one process (the
  default) nothing happens. Must run before any other JAX call that touches
  devices.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: N, the number of learner processes.
    process_id: this process's index in ``[0, N)``.
    initialization_timeout: seconds to wait for all processes to join.

  Returns:
    True when this process joined a job of more than one process.

  Raises:
    ValueError: naming the flag / variable that is missing or out of range.
  """
  global _initialized
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = int(num_processes if num_processes is not None else os.environ.get(ENV_NUM_PROCESSES, 1))
  if process_id is None and os.environ.get(ENV_PROCESS_ID) is not None:
    process_id = int(os.environ[ENV_PROCESS_ID])
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes}: expected >= 1")
  if num_processes == 1:
    return False
  if not coordinator_address:
    raise ValueError(f"num_processes={num_processes} needs a coordinator address (--coordinator_address or "
                     f"{ENV_COORDINATOR}=host:port of process 0)")
  if process_id is None or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id}: expected an integer in [0, {num_processes}) "
                     f"(--process_id or {ENV_PROCESS_ID})")
  if _initialized:
    return True
  # CPU devices of different processes talk over TCP (gloo); GPUs and TPUs use their own fabric.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=initialization_timeout)
  _initialized = True
  return True


def is_main_process() -> bool:
  """True in process 0 (the one that writes logs, plots and exports)."""
  return jax.process_index() == 0


def _fully_addressable(x: Any) -> bool:
  return not isinstance(x, jax.Array) or x.is_fully_addressable


def to_host(tree: Any) -> Any:
  """Every leaf as a NumPy array, gathering shards that live in other processes.

  A collective when any leaf is not fully addressable: every process must call
  it with the same tree at the same point of the program.

  Args:
    tree: pytree of arrays (jax or NumPy; ``None`` leaves stay).

  Returns:
    The same pytree of NumPy arrays (full global values).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if all(_fully_addressable(x) for x in leaves):
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  remote = [i for i, x in enumerate(leaves) if not _fully_addressable(x)]
  gathered = multihost_utils.process_allgather([leaves[i] for i in remote], tiled=True)
  out = [np.asarray(x) if _fully_addressable(x) else None for x in leaves]
  for i, value in zip(remote, gathered):
    out[i] = np.asarray(value)
  return jax.tree.unflatten(treedef, out)


def local_copy(tree: Any, device: Optional[jax.Device] = None) -> Any:
  """The whole value of every leaf on one local device (default: this process's first).

  Shards on this process's devices are assembled by a device copy; shards on
  other processes' devices come through :func:`to_host` (a collective then).
  Pure data movement: the bits are those of the source arrays.

  Args:
    tree: pytree of arrays, possibly sharded over a multi-process mesh.
    device: the target device.

  Returns:
    The same pytree, every leaf on ``device``.
  """
  device = device or jax.local_devices()[0]
  leaves, treedef = jax.tree.flatten(tree)
  if not all(_fully_addressable(x) for x in leaves):
    leaves = jax.tree.leaves(to_host(leaves))
  return jax.tree.unflatten(treedef, [jax.device_put(x, device) for x in leaves])
