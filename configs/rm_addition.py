"""A reward model for addition, trained on the built-in preference pairs (no download).

  jaxrl-train --config=configs/rm_addition.py        # -> runs/rm_addition/hf_export

The model is the addition policy's decoder (configs/addition_base.py) with a
scalar reward head read at the EOS token. Its trunk first gets a supervised warm
start on gold sums, three times longer than the policy's (1200 SFT steps, so the
trunk can add: a verifier has to know the answer), then 600 steps of the
Bradley-Terry loss on 64 pairs made from training problems: the correct
(reversed) sum is preferred to a wrong one (a digit changed, a carry error of
+-1 or +-10, a digit dropped or added) or to the correct sum padded with zeros.
Held-out pairwise accuracy is measured on 512 pairs from the held-out problems
(those the RL runs evaluate on), per kind of wrong answer.

Measured (bench/README.md): held-out pairwise accuracy 0.45 after the warm start
(chance) -> 0.92 after reward training; a shorter warm start (400 steps) gave 0.86,
lr 1e-3 gave 0.88, and a language-model term on the chosen responses
(reward_model.lm_coef=1) did not help (0.88 at step 350 vs 0.90).

configs/ppo_rm_addition.py uses the export as its reward and critic initialisation.
"""

from configs.addition_base import addition_config


def get_config():
  c = addition_config("rm_addition")
  c.job = "reward_model"
  c.sft.steps = 1200
  c.reward_model.steps = 600
  c.reward_model.batch_size = 64
  c.reward_model.lr = 3e-4
  c.reward_model.eval_pairs = 512
  c.optimizer.warmup_steps = 20
  c.eval.every = 50
  return c
