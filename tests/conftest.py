"""Test-session setup: eight CPU devices, and a persistent XLA compilation cache.

Both must be in place before JAX is first imported, so they live here, in the
environment: the subprocesses that tests start (``launch.train``, the
multi-host and experiment runs, the determinism workers) inherit them.

Compiling dominates the suite's time. The cache keeps every compiled program
(``min_compile_time_secs=0``) under the user cache folder, so a second session
on the same machine, and the subprocesses of one session, reuse them. Set
``JAXRL_TEST_XLA_CACHE`` to another folder, or to ``off`` to compile everything.
A cache entry is keyed by the program, the compile options, the XLA flags and
the jax/jaxlib versions, so a stale entry is never used.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def xla_cache_dir() -> str | None:
  """The persistent compilation cache folder of the tests, or None when switched off."""
  chosen = os.environ.get("JAXRL_TEST_XLA_CACHE", "")
  if chosen.lower() in ("off", "0", "none", "false"):
    return None
  if chosen:
    return os.path.abspath(os.path.expanduser(chosen))
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "jaxrl_llm", "xla")


XLA_CACHE = xla_cache_dir()
CACHE_ENV = {}
if XLA_CACHE:
  os.makedirs(XLA_CACHE, exist_ok=True)
  CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": XLA_CACHE,
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  os.environ.update(CACHE_ENV)
  import jax  # pylint: disable=wrong-import-position

  # a plugin may have imported jax before this file: the environment alone would then come too late
  jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
