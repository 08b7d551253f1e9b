"""Checkpoint manifests: the sha256 of every file of a checkpoint folder, written last, and their check.

``manifest.json`` (in the checkpoint folder, see :mod:`jaxrl_llm.learner.checkpoint`)::

  {"format": "jaxrl_llm.checkpoint/1", "step": 12, "finite": true,
   "config_sha256": "<sha256 of config.json>" | null, "written": <unix time>,
   "files": {"state/_METADATA": {"bytes": 599, "sha256": "..."}, ...}}

It lists every other file of the folder. Files are hashed in parallel threads
(hashlib releases the GIL), so the cost is about one read of the checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from typing import Any, Optional

__all__ = ["FORMAT", "MANIFEST", "verify_folder", "write_json", "write_manifest"]

FORMAT = "jaxrl_llm.checkpoint/1"
MANIFEST = "manifest.json"
_CHUNK = 1 << 23


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)  # releases the GIL: files hash in parallel threads
  return h.hexdigest()


def _files(folder: str) -> list[str]:
  out = []
  for root, _, names in os.walk(folder):
    out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
  return sorted(p for p in out if p != MANIFEST)


def _hashes(folder: str, rels: list[str]) -> dict[str, str]:
  with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
    return dict(zip(rels, pool.map(lambda r: _sha256(os.path.join(folder, r)), rels)))


def write_json(path: str, doc: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(doc, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_manifest(folder: str, step: int, config_sha256: Optional[str]) -> dict:
  """Hashes every file of ``folder`` and writes ``manifest.json`` (the last file of a checkpoint)."""
  rels = _files(folder)
  digests = _hashes(folder, rels)
  manifest = {"format": FORMAT, "step": step, "finite": True, "config_sha256": config_sha256, "written": time.time(),
              "files": {r: {"bytes": os.path.getsize(os.path.join(folder, r)), "sha256": digests[r]} for r in rels}}
  write_json(os.path.join(folder, MANIFEST), manifest)
  return manifest


def verify_folder(folder: str, step: int, hashes: bool = True) -> tuple[str, str]:
  """``("ok" | "legacy" | "bad", reason)`` for the checkpoint folder of ``step``.

  "legacy": no manifest but an orbax checkpoint (written before manifests);
  "bad": unreadable manifest, wrong step, not finite, a file missing, of the
  wrong size or (``hashes``) with the wrong sha256.
  """
  path = os.path.join(folder, MANIFEST)
  if not os.path.exists(path):
    if os.path.exists(os.path.join(folder, "_CHECKPOINT_METADATA")):
      return "legacy", "no manifest (written before checkpoints were verified)"
    return "bad", "no manifest and no orbax metadata"
  try:
    with open(path) as f:
      manifest = json.load(f)
    files = manifest["files"]
    if manifest.get("step") != step or manifest.get("finite") is not True:
      return "bad", f"manifest says step {manifest.get('step')}, finite {manifest.get('finite')}"
    for rel, want in files.items():
      full = os.path.join(folder, rel)
      if not os.path.isfile(full):
        return "bad", f"{rel} is missing"
      if os.path.getsize(full) != want["bytes"]:
        return "bad", f"{rel} has {os.path.getsize(full)} bytes, the manifest says {want['bytes']}"
    if hashes:
      for rel, got in _hashes(folder, sorted(files)).items():
        if got != files[rel]["sha256"]:
          return "bad", f"sha256 mismatch in {rel}"
  except (OSError, ValueError, KeyError, TypeError) as e:
    return "bad", f"unreadable: {type(e).__name__}: {e}"
  return "ok", ""
