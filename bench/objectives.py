"""GRPO objective (advantages + loss + metrics + d loss / d logp): jitted JAX vs PyTorch eager.

One step computes, for B = 256 sequences of T = 1024 tokens (32 prompts x 8 samples):
group-relative advantages (``jaxrl_llm.advantages.grpo_advantages``), the GRPO
objective (``recipes.grpo()``: PPO clip 0.2, k3 KL loss 0.04, sequence mean of token
means), every metric it reports (clip fractions, ratio mean/min/max and p1/p50/p99,
KL estimates, ESS, masked share, ...) and the gradient w.r.t. the log-probabilities.
Three implementations of the same maths run in the same process on the same data:

* ``jax``: ``jax.jit`` of ``objective_loss`` under ``value_and_grad`` (deterministic,
  batch-invariant reductions of ``jaxrl_llm.reduce``);
* ``jax_plain``: the same code traced with ``jaxrl_llm.reduce.tree_sum`` replaced by
  ``jnp.sum`` (the cost of determinism is the ratio of the two);
* ``torch``: the same maths written in PyTorch eager (CPU), with the thread count
  set to what XLA uses (the machine's cores), ``loss.backward()`` for the gradient.

Reported: median of ``--repeats`` timed calls (interleaved rounds of the three) after
``--warmup`` calls of each; the speed-up
of ``jax`` over ``torch`` (target >= 3x) and the overhead of ``jax`` over
``jax_plain`` (target <= 1.3x). The three losses are checked to agree.

Usage (from the repository root)::

  python -m bench.objectives                 # B=256, T=1024
  python -m bench.objectives --batch 64 --tokens 256 --repeats 3   # quick check

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Optional, Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import emit, load_average, time_calls, timing_stats
from jaxrl_llm import objectives as O
from jaxrl_llm import reduce
from jaxrl_llm.advantages import grpo_advantages, sequence_to_tokens

TARGET_SPEEDUP = 3.0
TARGET_DETERMINISM_OVERHEAD = 1.3
GROUP = 8
EPS, KL_COEF, QUANTILES = 0.2, 0.04, (0.01, 0.5, 0.99)


def make_data(b: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(t // 4, t + 1, b)
  mask = np.arange(t)[None, :] < lengths[:, None]
  logp = rng.normal(-1.5, 0.6, (b, t)).astype(np.float32)
  return dict(logp=logp, mask=mask,
              behaviour=(logp + rng.normal(0, 0.15, (b, t))).astype(np.float32),
              ref=(logp + rng.normal(0, 0.1, (b, t))).astype(np.float32),
              rewards=rng.integers(0, 2, b).astype(np.float32))


# ----------------------------------------------------------------------------- JAX


def jax_step_fn():
  objective = O.recipes.grpo(EPS, kl_coef=KL_COEF)
  state = objective.init(None)

  def step(logp, behaviour, ref, mask, rewards):
    adv = sequence_to_tokens(grpo_advantages(rewards, GROUP).advantages_b, mask)

    def loss_fn(logp):
      return O.objective_loss(objective, logp, mask_bt=mask, advantages_bt=adv,
                              behaviour_logp_bt=behaviour, ref_logp_bt=ref, state=state,
                              group_size=GROUP, quantiles=QUANTILES)

    (loss, (metrics, _)), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    return loss, metrics, grad

  return jax.jit(step)


def _plain_tree_sum(x, axis=0, axis_name=None):
  out = jnp.sum(jnp.asarray(x), axis=axis)
  return jax.lax.psum(out, axis_name) if axis_name is not None else out


@contextlib.contextmanager
def plain_reductions():
  """While tracing: ``reduce.tree_sum`` (under every reduce function) is ``jnp.sum``."""
  with mock.patch.object(reduce, "tree_sum", _plain_tree_sum):
    yield


# ----------------------------------------------------------------------------- PyTorch


def torch_step_fn(threads: int):
  import torch  # bench only: never imported by the library

  torch.set_num_threads(threads)

  def quantiles(values, valid, qs):
    values, valid = values.reshape(-1), valid.reshape(-1)
    k = int(valid.sum())
    ordered = torch.sort(torch.where(valid, values, torch.full_like(values, float("inf"))))[0]
    idx = [min(max(int(np.ceil(np.float32(q) * np.float32(k))) - 1, 0), max(k - 1, 0))
           for q in qs]
    return ordered[idx]

  def token_mean(v, m, n):
    return (v * m).sum() / n

  def masked_min(v, mask):
    return torch.where(mask, v, torch.full_like(v, float("inf"))).min()

  def masked_max(v, mask):
    return torch.where(mask, v, torch.full_like(v, -float("inf"))).max()

  def step(logp_np, behaviour_np, ref_np, mask_np, rewards_np):
    logp = torch.from_numpy(logp_np).requires_grad_(True)
    behaviour, ref = torch.from_numpy(behaviour_np), torch.from_numpy(ref_np)
    mask_b = torch.from_numpy(mask_np)
    rewards = torch.from_numpy(rewards_np)
    m = mask_b.float()
    # GRPO advantages: (r - mean_g) / (std_g + 1e-6), zero for zero-variance groups.
    r_gn = rewards.view(-1, GROUP)
    mean = r_gn.mean(1, keepdim=True)
    std = r_gn.std(1, unbiased=False, keepdim=True)
    adv_gn = (r_gn - mean) / (std + 1e-6)
    adv_gn = torch.where(r_gn.max(1, keepdim=True)[0] == r_gn.min(1, keepdim=True)[0],
                         torch.zeros_like(adv_gn), adv_gn)
    adv = adv_gn.reshape(-1, 1) * m
    # GRPO objective.
    ratio = torch.exp(logp - behaviour)
    unclipped = ratio * adv
    obj = torch.minimum(unclipped, torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv)
    d = ref - logp
    k3 = torch.exp(d) - 1 - d
    surrogate = -obj + KL_COEF * k3
    n_b = m.sum(1)
    valid = n_b > 0
    per_seq = (surrogate * m).sum(1) / n_b.clamp(min=1)
    loss = per_seq[valid].sum() / valid.sum()
    loss.backward()
    # Metrics (as reported by the JAX objective).
    with torch.no_grad():
      n = m.sum()
      r = ratio.detach()
      lr = logp.detach() - behaviour
      r_mu = torch.exp(lr)
      metrics = {
          "ppo_clip/clip_frac_low": token_mean(((adv < 0) & (r < 1 - EPS)).float(), m, n),
          "ppo_clip/clip_frac_high": token_mean(((adv > 0) & (r > 1 + EPS)).float(), m, n),
          "kl_loss/kl_mean": token_mean(k3.detach(), m, n),
          "kl_loss/k1_mean": token_mean(-d.detach(), m, n),
          "ratio_mean": token_mean(r_mu, m, n),
          "ratio_min": masked_min(r_mu, mask_b), "ratio_max": masked_max(r_mu, mask_b),
          "approx_kl_k1": token_mean(-lr, m, n),
          "approx_kl_k3": token_mean(torch.expm1(lr) - lr, m, n),
          "ess": (m.sum() ** 2) / (m * m).sum() / n,
          "masked_share": torch.zeros(()), "tokens": n, "sequences": valid.sum(),
          "loss": loss.detach(), "all_masked": (n == 0).float(),
      }
      # On-policy data (no proximal policy): the PPO ratio is pi / mu, whose stats the
      # objective reports once, as ratio_*.
      for q, v in zip(QUANTILES, quantiles(r_mu, mask_b, QUANTILES)):
        metrics[f"ratio_p{q * 100:g}"] = v
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, logp.grad.numpy()

  return step


# ----------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  a = parser.parse_args(argv)
  if a.batch % GROUP:
    parser.error(f"--batch must be a multiple of the group size {GROUP}")

  data = make_data(a.batch, a.tokens)
  args_np = (data["logp"], data["behaviour"], data["ref"], data["mask"], data["rewards"])
  args_jax = tuple(jnp.asarray(x) for x in args_np)

  jax_step = jax_step_fn()
  start = time.perf_counter()
  jax.block_until_ready(jax_step(*args_jax))
  compile_s = time.perf_counter() - start
  plain_step = jax_step_fn()
  with plain_reductions():
    jax.block_until_ready(plain_step(*args_jax))  # traced (and compiled) with jnp.sum
  torch_step = torch_step_fn(a.threads)

  # Same maths: losses, gradients and metrics agree.
  loss_j, metrics_j, grad_j = jax_step(*args_jax)
  loss_p, _, _ = plain_step(*args_jax)
  loss_t, metrics_t, grad_t = torch_step(*args_np)
  max_grad_diff = float(np.max(np.abs(np.asarray(grad_j) - grad_t)) / np.max(np.abs(grad_t)))
  metric_diffs = {k: abs(float(metrics_j[k]) - v) for k, v in metrics_t.items()}
  if not (np.isclose(float(loss_j), loss_t, rtol=1e-4, atol=1e-6)
          and np.isclose(float(loss_p), loss_t, rtol=1e-4, atol=1e-6)
          and max_grad_diff < 1e-4 and max(metric_diffs.values()) < 1e-4):
    raise AssertionError(f"implementations disagree: loss jax {float(loss_j)} plain "
                         f"{float(loss_p)} torch {loss_t}; grad {max_grad_diff}; metrics "
                         f"{max(metric_diffs.items(), key=lambda kv: kv[1])}")

  calls = {
      "jax": lambda: jax.block_until_ready(jax_step(*args_jax)),
      "jax_plain": lambda: jax.block_until_ready(plain_step(*args_jax)),
      "torch": lambda: torch_step(*args_np),
  }
  for fn in calls.values():
    time_calls(fn, 1, a.warmup)
  # Interleaved rounds, so that a change of machine load hits all three alike.
  timings = {k: [] for k in calls}
  for _ in range(a.repeats):
    for k, fn in calls.items():
      timings[k] += time_calls(fn, 1)
  stats = {k: timing_stats(v) for k, v in timings.items()}
  speedup = stats["torch"]["median_s"] / stats["jax"]["median_s"]
  speedup_min = stats["torch"]["min_s"] / stats["jax"]["min_s"]
  overhead = stats["jax"]["median_s"] / stats["jax_plain"]["median_s"]
  for name, s in stats.items():
    print(f"{name:10s} median {s['median_s'] * 1e3:8.2f} ms  (min {s['min_s'] * 1e3:.2f}, "
          f"max {s['max_s'] * 1e3:.2f}, n={s['n']})")
  print(f"speed-up jax vs torch eager: {speedup:.2f}x (of the fastest calls: "
        f"{speedup_min:.2f}x; target >= {TARGET_SPEEDUP}x); "
        f"deterministic reductions vs jnp.sum: {overhead:.2f}x "
        f"(target <= {TARGET_DETERMINISM_OVERHEAD}x); jax compile {compile_s:.1f} s")
  result = {
      "bench": "objectives", "batch": a.batch, "tokens": a.tokens, "group": GROUP,
      "threads": a.threads, "repeats": a.repeats, "warmup": a.warmup,
      "jax_version": jax.__version__, "load_average": load_average(),
      "timings": stats, "jax_compile_s": compile_s,
      "speedup_vs_torch": speedup, "speedup_vs_torch_min": speedup_min,
      "target_speedup": TARGET_SPEEDUP,
      "meets_speedup_target": speedup >= TARGET_SPEEDUP,
      "determinism_overhead": overhead, "target_overhead": TARGET_DETERMINISM_OVERHEAD,
      "meets_overhead_target": overhead <= TARGET_DETERMINISM_OVERHEAD,
      "max_rel_grad_diff_vs_torch": max_grad_diff,
  }
  emit(result)
  return result


if __name__ == "__main__":
  main()
