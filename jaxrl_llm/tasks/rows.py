"""Rows of a dataset file as ``(row number, dict)``: JSONL, parquet, JSON, or a Hugging Face ``datasets`` folder.

:func:`read_rows` is how prompt tasks (:class:`jaxrl_llm.tasks.JsonlTask`), preference pairs
and demonstration files read their rows, so the field mapping, the validation (a bad row
names the file and its number) and the training order are the same whatever the format:

  path                                   read with                          row number
  a folder (``Dataset.save_to_disk``)    ``datasets.load_from_disk``        row index + 1
  ``*.parquet``                          ``datasets.Dataset.from_parquet``  row index + 1
  ``*.json`` (an array or JSON lines)    ``datasets.Dataset.from_json``     row index + 1
  anything else (``*.jsonl``)            :func:`read_jsonl_objects`         line number

Only local files: nothing is fetched from the Hub. The ``datasets`` package is needed for the
first three (the ``[data]`` extra); a missing package is an error naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

DATASET_SUFFIXES = (".parquet", ".json")
INSTALL = "pip install 'jaxrl_llm[data]'"


def read_rows(path: str) -> Iterator[tuple[int, dict]]:
  """``(number, row)`` of every row of ``path`` (see the module's table).

  Raises:
    ValueError: naming the file (and the row) for a file that cannot be read, a datasets
      folder of several splits (name one), a row that is not an object, or a missing package.
  """
  if os.path.isdir(path) or path.endswith(DATASET_SUFFIXES):
    yield from _dataset_rows(path)
  else:
    yield from read_jsonl_objects(path)


def _dataset_rows(path: str) -> Iterator[tuple[int, dict]]:
  if not os.path.exists(path):
    raise ValueError(f"{path}: no such file or folder")
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"{path}: reading a parquet or JSON file or a datasets folder needs the datasets package "
                     f"({INSTALL})") from None
  try:
    if os.path.isdir(path):
      data = datasets.load_from_disk(path, keep_in_memory=True)
    elif path.endswith(".parquet"):
      data = datasets.Dataset.from_parquet(path, keep_in_memory=True)
    else:
      data = datasets.Dataset.from_json(path, keep_in_memory=True)
  except Exception as e:  # pyarrow / datasets raise many types for an unreadable file
    raise ValueError(f"{path}: cannot read it as a {'datasets folder' if os.path.isdir(path) else 'dataset file'} "
                     f"({type(e).__name__}: {e})") from None
  if isinstance(data, datasets.DatasetDict):
    raise ValueError(f"{path}: a datasets folder of several splits {sorted(data)}; name one, e.g. "
                     f"{os.path.join(path, sorted(data)[0])}")
  for index, row in enumerate(data):
    if not isinstance(row, dict):
      raise ValueError(f"{path}: row {index + 1}: expected a record, got {type(row).__name__}")
    yield index + 1, row


def read_jsonl_objects(path: str) -> Iterator[tuple[int, dict]]:
  """``(line number, row)`` of every non-blank line of a JSONL file, each a JSON object.

  The file is UTF-8 (a byte-order mark on the first line is accepted); each line is
  decoded on its own, so an undecodable byte is reported with its line.

  Raises:
    ValueError: ``path:line: ...`` for a line that is not UTF-8, not valid JSON or not an object.
  """
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line: "
                         f"{e.reason}); re-encode the file as UTF-8") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
      yield lineno, row
