"""The learner's optax chain: global-norm clipping, AdamW, LR warm-up and schedule.

The learning rate is an injected hyper-parameter (``optax.inject_hyperparams``)
so that controllers (for instance the improvement guard shrinking the LR after
a rollback) can change it inside the optimizer state without rebuilding or
recompiling anything.
"""

from __future__ import annotations

import optax

from jaxrl_llm.learner.update import TrainablePart

SCHEDULES = ("constant", "cosine", "linear")


def make_schedule(lr: float, warmup_steps: int, total_steps: int, schedule: str = "constant") -> optax.Schedule:
  """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then the named decay.

  Args:
    lr: peak learning rate (> 0).
    warmup_steps: steps of linear warm-up (>= 0).
    total_steps: total optimizer steps (used by decaying schedules).
    schedule: one of ``SCHEDULES``.
  """
  if lr <= 0:
    raise ValueError(f"optimizer.lr={lr}: expected > 0")
  if warmup_steps < 0:
    raise ValueError(f"optimizer.warmup_steps={warmup_steps}: expected >= 0")
  if schedule not in SCHEDULES:
    raise ValueError(f"optimizer.schedule={schedule!r}: expected one of {SCHEDULES}")
  decay_steps = max(1, total_steps - warmup_steps)
  if schedule == "constant":
    after = optax.constant_schedule(lr)
  elif schedule == "cosine":
    after = optax.cosine_decay_schedule(lr, decay_steps, alpha=0.1)
  else:
    after = optax.linear_schedule(lr, 0.1 * lr, decay_steps)
  if warmup_steps == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def make_optimizer(lr: float, warmup_steps: int = 0, total_steps: int = 1, schedule: str = "constant",
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   max_grad_norm: float = 1.0) -> optax.GradientTransformation:
  """``clip_by_global_norm -> adamw(schedule × lr_scale)``.

  The optimizer state carries a ``lr_scale`` hyper-parameter (initially 1.0)
  multiplying the scheduled learning rate; see :func:`set_lr_scale`.
  """
  if max_grad_norm is not None and max_grad_norm <= 0:
    raise ValueError(f"optimizer.max_grad_norm={max_grad_norm}: expected > 0 (or None to disable)")
  sched = make_schedule(lr, warmup_steps, total_steps, schedule)

  @optax.inject_hyperparams
  def scaled(lr_scale):
    return optax.scale(lr_scale)

  parts = []
  if max_grad_norm is not None:
    parts.append(optax.clip_by_global_norm(max_grad_norm))
  parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  parts.append(scaled(lr_scale=1.0))
  return optax.chain(*parts)


def _find_scale_state(opt_state):
  for s in opt_state:
    if "lr_scale" in getattr(s, "hyperparams", {}):
      return s
  raise ValueError("optimizer state has no lr_scale hyper-parameter; build it with make_optimizer")


def get_lr_scale(opt_state) -> float:
  return float(_find_scale_state(opt_state).hyperparams["lr_scale"])


def set_lr_scale(opt_state, value: float):
  """Returns ``opt_state`` with the LR multiplier set to ``value`` (no recompilation)."""
  target = _find_scale_state(opt_state)
  new = []
  for s in opt_state:
    if s is target:
      hp = dict(s.hyperparams)
      hp["lr_scale"] = hp["lr_scale"] * 0 + value
      s = s._replace(hyperparams=hp)
    new.append(s)
  return tuple(new)


def train_only(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` applied to the trainable leaves of a LoRA tree (adapters and scalar heads); the others get zero updates.

  The state is ``inner``'s state over the list of trainable leaves only
  (:class:`jaxrl_llm.learner.update.TrainablePart`), so optimizer memory is the adapters'
  size, and :func:`set_lr_scale` reads it as before. Gradient clipping and weight decay
  see the trainable leaves alone.

  Args:
    inner: the optimizer of the trainable leaves (e.g. :func:`make_optimizer`).
  """
  def init(params):
    return inner.init(TrainablePart(params).train)

  def update(updates, state, params=None):
    part = TrainablePart(updates)
    chosen, state = inner.update(part.train, state, None if params is None else TrainablePart(params).train)
    return part.expand(chosen), state

  return optax.GradientTransformation(init, update)
