"""Gathering one (possibly sharded, possibly multi-host) parameter to host memory."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(x: Any) -> np.ndarray:
  """Returns the full value of one parameter as a host numpy array.

  Args:
    x: a jax.Array (any sharding), or anything ``np.asarray`` accepts.

  Returns:
    The whole tensor on the host. A fully addressable array is copied from its
    shards; an array spread over several processes is all-gathered first
    (``multihost_utils.process_allgather``), so every process must call this
    in the same order. Only this one tensor is materialised.
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
