"""Batch-invariant mode: sampler behaviour log-probabilities == learner's, bit for bit.

The sampler computes them from a prefill + KV-cache decode of left-aligned
prompts of different lengths inside a padded batch bucket; the learner from one
full-sequence forward of the trajectory (``sequence_logprobs``, called at top
level with a traced temperature). Every response token must agree exactly,
including stop tokens, for temperature 1.0 and 0.7.
"""

import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.sampling import JaxSampler, SamplerConfig

CONFIG = models.tiny("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     max_position_embeddings=128, batch_invariant=True)
PROMPTS = [[10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, jax.random.PRNGKey(1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_sequence_logprobs_bitwise(params, temperature):
  sampler = JaxSampler(CONFIG, params, SamplerConfig(max_new_tokens=14, temperature=temperature,
                                                     stop_token_ids=(1, 2, 3), seed=0))
  traj = sampler.generate(PROMPTS, num_samples=2).trajectory
  mask = traj.prompt_mask_bt | traj.response_mask_bt
  logp = np.asarray(models.sequence_logprobs(params, CONFIG, traj.tokens_bt, mask, temperature))
  response = traj.response_mask_bt
  assert response.sum() > 30
  got, want = traj.behaviour_logp_bt[response], logp[response]
  assert got.tobytes() == want.tobytes(), np.abs(got - want).max()
  # the learner's values on a different batch composition (one row alone, padded longer) agree too
  alone = np.asarray(models.sequence_logprobs(params, CONFIG, np.pad(traj.tokens_bt[2:3], ((0, 0), (0, 9))),
                                              np.pad(mask[2:3], ((0, 0), (0, 9))), temperature))[0]
  assert alone[:mask.shape[1]][response[2]].tobytes() == traj.behaviour_logp_bt[2][response[2]].tobytes()
