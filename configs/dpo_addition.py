"""DPO of the addition policy on the built-in preference pairs (no download, no reward model, no sampling).

  jaxrl-train --config=configs/dpo_addition.py                          # DPO
  jaxrl-train --config=configs/dpo_addition.py --config.dpo.loss=ipo    # IPO (or simpo)

The policy of configs/addition_base.py first gets its usual 400-step SFT warm start on
gold sums, which becomes the frozen reference; then 200 DPO steps of 64 built-in pairs
made from training problems: the correct (reversed) sum is preferred to one with a digit
changed or a carry error of +-1 or +-10 (``reward_model.pair_kinds``: the errors the
policy makes; dropped / added digits and zero padding the warm start already ranks
right every time), lr 1e-4 (cosine), beta 0.5, with the chosen answers' per-token NLL added
at weight 1 (``dpo.nll_coef``, RPO). Measured on the 256 held-out problems
(those the RL runs evaluate on): the preferred-answer rate on 512 held-out pairs (the
policy's log-probability of the correct answer above the wrong one), the implicit-reward
accuracy and the greedy accuracy.

Measured (bench/README.md, "DPO on the built-in addition pairs"; before -> after):
  DPO + NLL (this config)  preferred rate 0.980 -> 0.990, greedy accuracy 0.742 -> 0.898,
         pass@4 0.852 -> 0.957 (428 s on the 2-core VM, warm start included)
Without the NLL term (--config.dpo.nll_coef=0):
  DPO    greedy accuracy 0.742 -> 0.766, implicit-reward accuracy 0.5 -> 0.93, held-out loss
         0.693 -> 0.368, preferred rate 0.980 -> 0.969 (already near its ceiling at the warm start)
  IPO    greedy accuracy 0.742 -> 0.777, preferred rate 0.980 -> 0.979
  SimPO  (dpo.beta=2) greedy accuracy 0.742 -> 0.793, preferred rate 0.979 -> 0.967
About 18 minutes each on the shared 2-core VM, three at a time. At beta 0.1 and lr 3e-4
DPO lowered both answers' log-probabilities and the greedy accuracy fell to 0.50.
"""

from configs.addition_base import addition_config


def get_config():
  c = addition_config("dpo_addition")
  c.job = "dpo"
  c.dpo.steps = 200
  c.dpo.batch_size = 64
  c.dpo.lr = 1e-4
  c.dpo.beta = 0.5
  c.dpo.simpo_gamma = 1.0
  c.dpo.nll_coef = 1.0
  c.reward_model.pair_kinds = "wrong_digit,carry"
  c.reward_model.eval_pairs = 512
  c.optimizer.warmup_steps = 20
  c.eval.every = 50
  return c
