"""Hypothesis properties: masked rows give zeros, no NaN when all is masked, padding-free bits."""

import jax
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxrl_llm import reduce
from jaxrl_llm.advantages import (
    gae,
    group_advantages,
    make_advantage_normalizer,
    sequence_to_tokens,
    whiten,
)

N = 2  # shapes drawn from a small set so that jit compilations are reused


@jax.jit
def advantages(rewards_b, values_bt, mask_bt):
  valid_b = reduce.row_count(mask_bt) > 0
  out = {"gae": gae(sequence_to_tokens(rewards_b, mask_bt), values_bt, mask_bt, gamma=0.9,
                    lam=0.95)[0]}
  out["whiten"] = whiten(out["gae"], mask_bt)
  for est in ("grpo", "dr_grpo", "rloo"):
    seq_b = group_advantages(rewards_b, N, estimator=est, valid_b=valid_b).advantages_b
    out[est] = sequence_to_tokens(seq_b, mask_bt)
  for mode, kw in (("batch", {}), ("group", {"group_size": N})):
    for level in ("token", "sequence"):
      out[f"{mode}_{level}"] = make_advantage_normalizer(mode, level=level, **kw)(
          out["gae"], mask_bt)
  return out


@st.composite
def batches(draw):
  groups = draw(st.sampled_from([1, 3]))
  t = 5
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  b = groups * N
  mask = np.zeros((b, t), bool)
  if not draw(st.booleans()) or draw(st.booleans()):     # 1 in 4 batches all masked
    for i in range(b):
      if rng.random() < 0.7:
        start = rng.integers(0, t)
        mask[i, start:rng.integers(start, t + 1)] = True
  rewards = rng.choice([0.0, 1.0, rng.normal()], size=b).astype(np.float32)
  values = rng.normal(size=(b, t)).astype(np.float32)
  return rewards, values, mask


SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


@SETTINGS
@given(batches())
def test_masked_entries_and_empty_rows_are_exact_zero_without_nan(batch):
  rewards, values, mask = batch
  out = jax.device_get(advantages(rewards, values, mask))
  for name, adv in out.items():
    assert np.all(np.isfinite(adv)), name
    assert np.all(adv[~mask] == 0.0), name
    assert np.all(adv[~mask.any(axis=1)] == 0.0), name
    if not mask.any():
      assert np.all(adv == 0.0), name


@SETTINGS
@given(batches())
def test_results_do_not_depend_on_padding(batch):
  pad_rows, pad_t = N, 3           # a padding group and trailing masked tokens
  rewards, values, mask = batch
  b, t = mask.shape
  ref = jax.device_get(advantages(rewards, values, mask))
  out = jax.device_get(advantages(
      np.pad(rewards, (0, pad_rows), constant_values=np.nan),
      np.pad(values, ((0, pad_rows), (0, pad_t)), constant_values=np.inf),
      np.pad(mask, ((0, pad_rows), (0, pad_t)))))
  for name in ref:
    np.testing.assert_array_equal(out[name][:b, :t].view(np.uint32), ref[name].view(np.uint32),
                                  err_msg=name)
    assert np.all(out[name][b:] == 0) and np.all(out[name][:, t:] == 0), name
