"""A reward served over HTTP: one batched request per scored batch, with a timeout and retries.

A ``reward.functions`` component named by a URL (``"http://10.0.0.5:8000/score"``) is scored
by a server. The request is ``POST <url>`` with the JSON body::

  {"items": [{"prompt": "...", "example": {...}, "response": "..."}, ...]}

(``example``: the task example's fields, for a JSONL task its row; values JSON cannot carry
are sent as strings) and the answer must be ``{"rewards": [r_0, r_1, ...]}``, one number
(or null, a failed item) per item, in order. A request that cannot connect, times out
(``reward.timeout_s``), gets an HTTP error or a malformed answer (not JSON, no ``rewards``,
the wrong length) is retried ``reward.remote_retries`` times with a doubling pause; then every
item of the batch scores 0 and is counted (``reward/<label>/timeouts`` or ``failures``), as a
failing local reward is, and a server that stays down for ``reward.failure_steps`` steps stops
the run naming the URL (``reward.max_failure_share``). Only the standard library is used.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np

from jaxrl_llm.tasks import workers as W
from jaxrl_llm.tasks.reward_runner import RewardRunner

SCHEMES = ("http://", "https://")


def is_url(name: str) -> bool:
  return isinstance(name, str) and name.startswith(SCHEMES) and len(name) > len("http://")


def example_json(example: Any) -> Any:
  """A task example as JSON-able data (a dataclass's fields, a mapping, or its text)."""
  if dataclasses.is_dataclass(example) and not isinstance(example, type):
    return dataclasses.asdict(example)
  if isinstance(example, dict):
    return example
  return str(example)


class RemoteReward:
  """The client of one reward server.

  Args:
    url: ``http(s)://host:port/path``.
    timeout_s: per request.
    retries: extra tries of a failed request.
    backoff_s: pause before the first retry (doubled for each next one).
  """

  def __init__(self, url: str, *, timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 0.25):
    if not is_url(url):
      raise ValueError(f"RemoteReward: {url!r} is not an http(s):// URL")
    self.url, self.timeout_s, self.retries, self.backoff_s = url, float(timeout_s), int(retries), float(backoff_s)
    self.requests = self.retried = 0

  def __call__(self, example: Any, response: str) -> float:
    """One item (a batch of one); raises when the server cannot score it."""
    status, value = self.outcomes([(example, response)])[0]
    if status != W.OK:
      raise RuntimeError(value)
    return value

  def outcomes(self, items: Sequence[tuple[Any, str]]) -> list[W.Outcome]:
    """One :class:`~jaxrl_llm.tasks.workers.Outcome` per item, from one request (with retries)."""
    body = json.dumps({"items": [{"prompt": getattr(e, "prompt", None), "example": example_json(e), "response": r}
                                 for e, r in items]}, default=str).encode("utf-8")
    last = ""
    status = W.ERROR
    for attempt in range(self.retries + 1):
      if attempt:
        self.retried += 1
        time.sleep(self.backoff_s * 2 ** (attempt - 1))
      self.requests += 1
      try:
        rewards = self._post(body, len(items))
        return [W.Outcome(W.OK, r) if r is not None else W.Outcome(W.ERROR, f"{self.url} returned null for item")
                for r in rewards]
      except (socket.timeout, TimeoutError) as e:
        status, last = W.TIMEOUT, f"{self.url}: no answer within reward.timeout_s={self.timeout_s:g} s ({e})"
      except urllib.error.HTTPError as e:
        status, last = W.ERROR, f"{self.url}: HTTP {e.code} {e.reason}"
      except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, (socket.timeout, TimeoutError))
        status = W.TIMEOUT if timed_out else W.ERROR
        last = f"{self.url}: {'no answer within reward.timeout_s' if timed_out else 'cannot connect'} ({e.reason})"
      except (OSError, ValueError) as e:  # a dropped connection, a malformed answer
        status, last = W.ERROR, f"{self.url}: {e}"
    why = f"{last} (after {self.retries + 1} tries)"
    return [W.Outcome(status, why) for _ in items]

  def _post(self, body: bytes, count: int) -> list:
    request = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:  # noqa: S310 (a configured URL)
      data = json.loads(answer.read().decode("utf-8"))
    rewards = data.get("rewards") if isinstance(data, dict) else None
    if not isinstance(rewards, list):
      raise ValueError(f"the answer has no list 'rewards' (got {str(data)[:200]!r})")
    if len(rewards) != count:
      raise ValueError(f"the answer has {len(rewards)} rewards for {count} items")
    return rewards


class RemoteRewardRunner(RewardRunner):
  """A :class:`~jaxrl_llm.tasks.RewardRunner` whose batch is one request to a :class:`RemoteReward`.

  Counters, the failure-rate stop and the checkpointed state are the base runner's; only
  how a batch is scored differs (no worker processes: the work is the server's).
  """

  def __init__(self, client: RemoteReward, *, name: str, max_failure_share: float = 0.5, failure_steps: int = 3):
    super().__init__(client, name=name, mode="inline", timeout_s=client.timeout_s,
                     max_failure_share=max_failure_share, failure_steps=failure_steps)
    self.client = client

  def score(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
    items = [tuple(p) for p in pairs]
    started = time.monotonic()
    rewards_b = self._record(items, self.client.outcomes(items) if items else [])
    self.seconds += time.monotonic() - started
    return rewards_b

  __call__ = score


__all__ = ["RemoteReward", "RemoteRewardRunner", "SCHEMES", "example_json", "is_url"]
