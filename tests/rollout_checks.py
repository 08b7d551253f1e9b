"""Assertions shared by the rollout tests."""

import numpy as np

TRAJECTORY_FIELDS = ("tokens_bt", "prompt_mask_bt", "response_mask_bt", "behaviour_logp_bt", "policy_version_bt",
                     "group_id_b", "rewards_b", "finished_b")


def assert_same_chunk(a, b):
  """Two RolloutChunks hold the same responses and trajectory arrays, bit for bit (dtypes included)."""
  assert a.response_tokens == b.response_tokens
  for name in TRAJECTORY_FIELDS:
    x, y = np.asarray(getattr(a.trajectory, name)), np.asarray(getattr(b.trajectory, name))
    assert x.dtype == y.dtype, name
    np.testing.assert_array_equal(x, y, err_msg=name)
