"""Named recipes against an independent float64 NumPy reference: values and gradients.

The reference below re-derives each objective and its gradient w.r.t. log pi_theta
by hand (it does not import the library's maths); the hand-derived gradients are
themselves checked against central finite differences of the reference loss.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives as O

B, T, N = 8, 12, 4  # sequences, tokens, samples per prompt
C = 16.0  # Dr.GRPO's constant normaliser


# ----------------------------------------------------------------------------- data


def make_batch(seed):
  rng = np.random.default_rng(seed)
  lengths = np.array([12, 7, 1, 9, 12, 4, 0, 10])  # row 6 is padding
  mask = np.arange(T)[None, :] < lengths[:, None]
  x = rng.normal(-1.5, 0.5, (B, T))
  # Rows 0-3 nearly on-policy (GSPO's tiny clip range is active only there), rows 4-7 stale.
  scale = np.where(np.arange(B) < 4, 1e-4, 0.15)[:, None]
  mu = x + rng.normal(0, 1, (B, T)) * scale
  prox = mu + rng.normal(0, 1, (B, T)) * scale
  adv_seq = rng.normal(0, 1, B)
  fields = dict(
      mask_bt=mask,
      advantages_bt=np.repeat(adv_seq[:, None], T, 1),
      behaviour_logp_bt=mu,
      prox_logp_bt=prox,
      ref_logp_bt=x + rng.normal(0, 0.2, (B, T)),
      values_bt=rng.normal(0, 1, (B, T)),
      old_values_bt=rng.normal(0, 1, (B, T)),
      returns_bt=rng.normal(0, 1, (B, T)),
  )
  fields["old_values_bt"] = fields["values_bt"] + rng.normal(0, 0.3, (B, T))
  # Values in padding are junk: they must not matter.
  for k in ("behaviour_logp_bt", "prox_logp_bt", "ref_logp_bt", "values_bt"):
    fields[k] = np.where(mask, fields[k], np.nan)
  x = np.where(mask, x, np.nan)
  f32 = {k: (v if v.dtype == bool else v.astype(np.float32)) for k, v in fields.items()}
  # The reference sees exactly the float32 inputs, in float64.
  f64 = {k: (v if v.dtype == bool else v.astype(np.float64)) for k, v in f32.items()}
  return x.astype(np.float32), f32, x.astype(np.float32).astype(np.float64), f64


# ----------------------------------------------------------------------------- NumPy reference


def clip_obj(r, a, lo, hi):
  """min(r A, clip(r, lo, hi) A) and its derivative w.r.t. r."""
  unclipped, clipped = r * a, np.clip(r, lo, hi) * a
  return np.minimum(unclipped, clipped), np.where(unclipped > clipped, 0.0, a)


def token_mean(s, ds, m):
  n = m.sum()
  return (s * m).sum() / n, ds * m / n


def seq_mean_token_mean(s, ds, m):
  n_b = m.sum(1)
  valid = n_b > 0
  nb = np.where(valid, n_b, 1)
  rows = (s * m).sum(1) / nb
  g = valid.sum()
  return rows[valid].sum() / g, ds * m / nb[:, None] / g


def seq_sum_norm(s, ds, m):
  valid = m.sum(1) > 0
  g = valid.sum()
  return ((s * m).sum(1) / C)[valid].sum() / g, ds * m / C / g


def prompt_mean(s, ds, m, n=N):
  """ScaleRL's prompt-level mean (arXiv:2510.13786 §3.2): pool all tokens of a prompt's samples.

  Per prompt (n contiguous rows): sum of its token losses / its number of tokens; then the mean
  over prompts with at least one token.
  """
  b = m.shape[0]
  tokens_g = m.reshape(b // n, -1).sum(1)
  sums_g = (s * m).reshape(b // n, -1).sum(1)
  valid = tokens_g > 0
  k = valid.sum()
  tg = np.where(valid, tokens_g, 1)
  return (sums_g / tg)[valid].sum() / k, ds * m / np.repeat(tg, n)[:, None] / k


def z(v, m):
  return np.where(m, v, 0.0)


def ref_ppo(x, f):
  m = f["mask_bt"]
  a = z(f["advantages_bt"], m)
  r = np.exp(z(x, m) - z(f["behaviour_logp_bt"], m))
  obj, dobj = clip_obj(r, a, 0.8, 1.2)
  v, vo, ret = z(f["values_bt"], m), z(f["old_values_bt"], m), z(f["returns_bt"], m)
  e1 = (v - ret) ** 2
  vc = vo + np.clip(v - vo, -0.2, 0.2)
  e2 = (vc - ret) ** 2
  s = -obj + 0.5 * 0.5 * np.maximum(e1, e2)
  loss, g = token_mean(s, -r * dobj, m)
  dv = np.where(e2 > e1, 0.0, 0.5 * 0.5 * 2 * (v - ret))
  _, gv = token_mean(s, dv, m)
  return loss, g, gv


def ref_grpo(x, f):
  m = f["mask_bt"]
  a = z(f["advantages_bt"], m)
  xx, ref = z(x, m), z(f["ref_logp_bt"], m)
  r = np.exp(xx - z(f["behaviour_logp_bt"], m))
  obj, dobj = clip_obj(r, a, 0.8, 1.2)
  k3 = np.exp(ref - xx) - 1 - (ref - xx)
  dk3 = -np.exp(ref - xx) + 1
  return seq_mean_token_mean(-obj + 0.04 * k3, -r * dobj + 0.04 * dk3, m)


def ref_dr_grpo(x, f):
  m = f["mask_bt"]
  r = np.exp(z(x, m) - z(f["behaviour_logp_bt"], m))
  obj, dobj = clip_obj(r, z(f["advantages_bt"], m), 0.8, 1.2)
  return seq_sum_norm(-obj, -r * dobj, m)


def ref_dapo(x, f):
  m = f["mask_bt"]
  r = np.exp(z(x, m) - z(f["behaviour_logp_bt"], m))
  obj, dobj = clip_obj(r, z(f["advantages_bt"], m), 0.8, 1.28)
  return token_mean(-obj, -r * dobj, m)


def ref_cispo(x, f, eps_high=0.1, weight_x=None, aggregation=token_mean):
  """CISPO; ``weight_x`` freezes the IS weight at another point (the stop-gradient)."""
  m = f["mask_bt"]
  xx, a = z(x, m), z(f["advantages_bt"], m)
  xw = xx if weight_x is None else z(weight_x, m)
  w = np.clip(np.exp(xw - z(f["behaviour_logp_bt"], m)), 0.0, 1.0 + eps_high)
  return aggregation(-w * a * xx, -w * a, m)


ref_cispo_prompt_mean = functools.partial(ref_cispo, aggregation=prompt_mean)  # ScaleRL


def ref_gspo(x, f):
  """Sequence-level GSPO (paper eq. 5-7), with the sequence's advantage."""
  m = f["mask_bt"]
  n_b = m.sum(1)
  valid = n_b > 0
  nb = np.where(valid, n_b, 1)
  s_i = np.exp((z(x, m) - z(f["prox_logp_bt"], m)).sum(1) / nb)
  a_i = f["advantages_bt"][:, 0]
  obj, dobj = clip_obj(s_i, a_i, 1 - 3e-4, 1 + 4e-4)
  g = valid.sum()
  loss = (-obj)[valid].sum() / g
  grad = (-dobj * s_i / nb)[:, None] * m / g  # d s_i / d x_t = s_i / n_i
  return loss, grad


def ref_decoupled(x, f):
  m = f["mask_bt"]
  p = z(f["prox_logp_bt"], m)
  rho_k = np.exp(p - z(f["behaviour_logp_bt"], m))
  r = np.exp(z(x, m) - p)
  obj, dobj = clip_obj(r, z(f["advantages_bt"], m), 0.8, 1.2)
  return token_mean(-rho_k * obj, -rho_k * r * dobj, m)


def ref_geppo(x, f):
  m = f["mask_bt"]
  mu = z(f["behaviour_logp_bt"], m)
  rho_k = np.exp(z(f["prox_logp_bt"], m) - mu)
  rho = np.exp(z(x, m) - mu)
  a = z(f["advantages_bt"], m)
  unclipped, clipped = rho * a, np.clip(rho, rho_k - 0.2, rho_k + 0.2) * a
  obj = np.minimum(unclipped, clipped)
  dobj = np.where(unclipped > clipped, 0.0, a)
  return token_mean(-obj, -rho * dobj, m)


# ----------------------------------------------------------------------------- reference metrics


def ref_geppo_tv_drift(x, f):
  """TV(pi_theta, pi_k) on samples of mu (arXiv:2111.00072): 0.5 E_mu |pi_theta/mu - pi_k/mu|."""
  m = f["mask_bt"]
  mu = z(f["behaviour_logp_bt"], m)
  return 0.5 * np.abs(np.exp(z(x, m) - mu) - np.exp(z(f["prox_logp_bt"], m) - mu))[m].mean()


def ref_value_clip_frac(f, eps=0.2):
  """Share of tokens whose value clip is active: |V - V_old| > eps and the clipped error larger."""
  m = f["mask_bt"]
  v, vo, ret = f["values_bt"][m], f["old_values_bt"][m], f["returns_bt"][m]
  e1 = (v - ret) ** 2
  e2 = (vo + np.clip(v - vo, -eps, eps) - ret) ** 2
  return ((np.abs(v - vo) > eps) & (e2 > e1)).mean()


REF_METRICS = {
    # case name: {metric: reference(x64, f64)}
    "ppo": {"value_loss/clip_frac": lambda x, f: ref_value_clip_frac(f)},
    "geppo": {"geppo_adaptive/tv_drift": ref_geppo_tv_drift},
}


CASES = {
    # name: (objective, reference, input fields used, prox given)
    "ppo": (O.recipes.ppo(), ref_ppo,
            ("values_bt", "old_values_bt", "returns_bt"), False),
    "grpo": (O.recipes.grpo(), ref_grpo, ("ref_logp_bt",), False),
    "dr_grpo": (O.recipes.dr_grpo(C), ref_dr_grpo, (), False),
    "dapo": (O.recipes.dapo(), ref_dapo, (), False),
    "cispo": (O.recipes.cispo(0.1), ref_cispo, (), False),
    "cispo_prompt_mean": (O.recipes.cispo(0.1, aggregation="prompt_mean"), ref_cispo_prompt_mean,
                          (), False),
    "gspo": (O.recipes.gspo(), ref_gspo, (), True),
    "decoupled_ppo": (O.recipes.decoupled_ppo(), ref_decoupled, (), True),
    "geppo": (O.recipes.geppo(), ref_geppo, (), True),
}


@functools.lru_cache(maxsize=None)
def _evaluator(name):
  objective, _, extra, with_prox = CASES[name]
  keys = ("mask_bt", "advantages_bt", "behaviour_logp_bt") + extra + (
      ("prox_logp_bt",) if with_prox else ())

  def f(x, values, fields):
    fields = dict(zip(keys, fields))
    if "values_bt" in fields:
      fields["values_bt"] = values
    return O.objective_loss(objective, x, state=objective.init(None), group_size=N, **fields)

  return keys, jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def evaluate(name, x, fields):
  keys, f = _evaluator(name)
  (loss, (metrics, _)), (gx, gv) = f(jnp.asarray(x), jnp.asarray(fields["values_bt"]),
                                     tuple(jnp.asarray(fields[k]) for k in keys))
  return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(gx), np.asarray(gv)


def finite_difference(fn, x, mask, h=1e-6):
  g = np.zeros_like(x)
  for idx in zip(*np.nonzero(mask)):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = (fn(xp)[0] - fn(xm)[0]) / (2 * h)
  return g


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_recipe_matches_numpy_reference(name, seed):
  x32, f32, x64, f64 = make_batch(seed)
  ref = CASES[name][1]
  out = ref(x64, f64)
  loss_ref, grad_ref = out[0], out[1]
  # The hand-derived reference gradient agrees with finite differences of the reference
  # loss (for CISPO with the IS weight held fixed: that is what its stop-gradient means).
  if name.startswith("cispo"):
    loss_fn = lambda x: ref(x, f64, weight_x=x64)
  else:
    loss_fn = lambda x: ref(x, f64)
  fd = finite_difference(loss_fn, np.where(f64["mask_bt"], x64, 0.0), f64["mask_bt"])
  np.testing.assert_allclose(grad_ref, fd, rtol=1e-4, atol=1e-7)

  loss, metrics, gx, gv = evaluate(name, x32, f32)
  assert loss == pytest.approx(loss_ref, rel=2e-5, abs=1e-6)
  np.testing.assert_allclose(gx, grad_ref, rtol=2e-4, atol=2e-6)
  assert np.all(gx[~f64["mask_bt"]] == 0.0)
  if name == "ppo":
    np.testing.assert_allclose(gv, out[2], rtol=2e-4, atol=2e-6)
  else:
    assert np.all(gv == 0.0)
  assert metrics["tokens"] == f64["mask_bt"].sum()
  assert metrics["all_masked"] == 0.0
  assert all(np.isfinite(v) for v in metrics.values())
  for metric, ref_metric in REF_METRICS.get(name, {}).items():
    assert metrics[metric] == pytest.approx(ref_metric(x64, f64), rel=2e-5, abs=1e-7), metric


def test_reference_covers_clipped_and_unclipped_tokens():
  """The random batches exercise both branches of every clip (else the tests above are weak)."""
  _, _, x64, f64 = make_batch(0)
  m = f64["mask_bt"]
  r = np.exp(x64 - f64["behaviour_logp_bt"])[m]
  a = f64["advantages_bt"][m]
  clipped = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))
  assert 0 < clipped.sum() < clipped.size
  _, grad = ref_gspo(x64, f64)
  live_rows = np.any(grad != 0, axis=1)
  assert live_rows.any() and not live_rows[m.any(1)].all()
  assert (np.exp(x64 - f64["behaviour_logp_bt"])[m] > 1.1).any()  # CISPO's cap binds
  assert 0 < ref_value_clip_frac(f64) < 1  # the value clip binds on some tokens only
  # Off-policy (pi_k != mu): GePPO's TV estimate differs from 0.5 E_mu |pi_theta / pi_k - 1|.
  wrong_tv = 0.5 * np.abs(np.exp(x64 - f64["prox_logp_bt"]) - 1)[m].mean()
  assert abs(wrong_tv - ref_geppo_tv_drift(x64, f64)) > 1e-3 * ref_geppo_tv_drift(x64, f64)
  # prompt_mean pools tokens: it differs from the mean over prompts of the samples' means.
  s = np.where(m, x64, 0.0)
  means_of_means = (s.sum(1) / np.maximum(m.sum(1), 1)).reshape(B // N, N)
  valid = m.sum(1).reshape(B // N, N) > 0
  old_def = np.mean([means_of_means[g][valid[g]].mean() for g in range(B // N)])
  assert abs(prompt_mean(s, s, m)[0] - old_def) > 1e-3


@pytest.mark.parametrize("name", sorted(CASES))
def test_all_masked_batch_gives_exact_zero(name):
  x32, f32, _, _ = make_batch(0)
  f32 = dict(f32, mask_bt=np.zeros((B, T), bool))
  junk = np.full((B, T), np.nan, np.float32)
  x32 = junk
  for k in f32:
    if k != "mask_bt":
      f32[k] = np.where(np.isnan(f32[k]), np.float32(1e30), f32[k])
  loss, metrics, gx, gv = evaluate(name, x32, f32)
  assert loss == 0.0 and np.signbit(loss) == 0
  assert metrics["all_masked"] == 1.0
  assert all(v == 0.0 for k, v in metrics.items() if k != "all_masked"), metrics
  assert np.all(gx == 0.0) and np.all(gv == 0.0)


# ----------------------------------------------------------------------------- regressions
# Defects found by an independent float64 re-implementation of the objectives.


def _single(objective, x, **fields):
  fields.setdefault("advantages_bt", np.zeros_like(x))
  fields.setdefault("behaviour_logp_bt", x)

  def f(x):
    return O.objective_loss(objective, x, state=objective.init(None), **fields)

  (loss, (metrics, _)), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(x))
  return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def test_prompt_mean_pools_the_tokens_of_a_prompt_regression():
  """One prompt, samples of 1 and 3 tokens, losses -1 and +1, +1, +1: (-1 + 3) / 4 = 0.5, not 0."""
  s = np.array([[-1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], np.float32)
  mask = np.array([[1, 0, 0], [1, 1, 1]], bool)
  obj = O.chain(O.stateless(lambda r: r.replace(surrogate_bt=r.surrogate_bt + s * r.logp_bt)),
                O.aggregate("prompt_mean"))
  x = np.ones((2, 3), np.float32)
  loss, metrics, grad = _single(obj, x, mask_bt=mask, group_size=2)
  assert loss == 0.5  # the mean of the samples' means would be 0
  assert loss == prompt_mean(s.astype(np.float64), s, mask, n=2)[0]
  np.testing.assert_array_equal(grad, np.where(mask, s / 4, 0.0))  # every token weighs 1/4
  # Two prompts: each pooled, then the mean over prompts; an empty prompt does not count.
  s2 = np.concatenate([s, np.array([[2.0, 2.0, 0.0], [4.0, 0.0, 0.0]], np.float32),
                       np.zeros((2, 3), np.float32)])
  mask2 = np.concatenate([mask, np.array([[1, 1, 0], [1, 0, 0]], bool), np.zeros((2, 3), bool)])
  obj2 = O.chain(O.stateless(lambda r: r.replace(surrogate_bt=r.surrogate_bt + s2 * r.logp_bt)),
                 O.aggregate("prompt_mean"))
  loss2, _, _ = _single(obj2, np.ones((6, 3), np.float32), mask_bt=mask2, group_size=2)
  assert loss2 == pytest.approx((0.5 + 8 / 3) / 2, rel=1e-6)
  assert loss2 == pytest.approx(prompt_mean(s2.astype(np.float64), s2, mask2, n=2)[0], rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geppo_tv_drift_is_total_variation_off_policy_regression(seed):
  """tv_drift = 0.5 E_mu |pi_theta/mu - pi_k/mu| (arXiv:2111.00072), not 0.5 E_mu |pi_theta/pi_k - 1|."""
  rng = np.random.default_rng(seed)
  b, t = 6, 10
  mask = np.arange(t)[None, :] < rng.integers(0, t + 1, (b, 1))
  mask[0] = True
  mu = rng.normal(-1.5, 0.5, (b, t))
  prox = mu + rng.normal(0, 0.4, (b, t))  # strongly off-policy
  x = prox + rng.normal(0, 0.2, (b, t))
  f32 = dict(mask_bt=mask, behaviour_logp_bt=mu.astype(np.float32),
             prox_logp_bt=prox.astype(np.float32),
             advantages_bt=rng.normal(0, 1, (b, t)).astype(np.float32))
  x32 = x.astype(np.float32)
  f64 = {k: (v if v.dtype == bool else v.astype(np.float64)) for k, v in f32.items()}
  obj = O.chain(O.geppo_adaptive(0.2), O.aggregate("token_mean"))
  _, metrics, _ = _single(obj, x32, **f32)
  want = ref_geppo_tv_drift(x32.astype(np.float64), f64)
  assert metrics["geppo_adaptive/tv_drift"] == pytest.approx(want, rel=1e-5)
  old = 0.5 * np.abs(np.exp(x32.astype(np.float64) - f64["prox_logp_bt"]) - 1)[mask].mean()
  assert abs(old - want) > 1e-3 * want  # off-policy the old estimate fails the check above
  # On-policy (pi_k = mu) both are 0.5 E |pi_theta / pi_k - 1|.
  on = dict(f32, prox_logp_bt=f32["behaviour_logp_bt"])
  _, metrics_on, _ = _single(obj, x32, **on)
  want_on = 0.5 * np.abs(np.exp(x32.astype(np.float64) - f64["behaviour_logp_bt"]) - 1)[mask].mean()
  assert metrics_on["geppo_adaptive/tv_drift"] == pytest.approx(want_on, rel=1e-5)


def test_value_loss_clip_frac_inside_the_window_regression():
  """V inside [V_old - eps, V_old + eps] is not clipped, though V_old + clip(V - V_old) != V."""
  v, v_old, ret = np.float32(0.028817441), np.float32(0.20676579), np.float32(-0.77121145)
  v_clip = v_old + np.clip(v - v_old, np.float32(-0.2), np.float32(0.2))
  assert v_clip != v and (v_clip - ret) ** 2 > (v - ret) ** 2  # the 1-ulp rounding
  # token 0: the quoted one; token 1: outside the window with the larger clipped error (clipped);
  # token 2: outside the window with the smaller clipped error (not clipped).
  values = np.array([[v, 0.9, -0.5]], np.float32)
  old = np.array([[v_old, 0.0, 0.0]], np.float32)
  rets = np.array([[ret, -1.0, -1.0]], np.float32)
  mask = np.ones((1, 3), bool)
  obj = O.chain(O.value_loss(coef=1.0, clip_eps=0.2), O.aggregate("token_mean"))

  def f(vals):
    return O.objective_loss(obj, jnp.zeros((1, 3)), mask_bt=mask, advantages_bt=jnp.zeros((1, 3)),
                            behaviour_logp_bt=jnp.zeros((1, 3)), values_bt=vals,
                            old_values_bt=old, returns_bt=rets, state=obj.init(None))

  (loss, (metrics, _)), gv = jax.value_and_grad(f, has_aux=True)(jnp.asarray(values))
  assert float(metrics["value_loss/clip_frac"]) == pytest.approx(1 / 3, rel=1e-6)  # was 2 / 3
  assert ref_value_clip_frac(dict(mask_bt=mask, values_bt=values.astype(np.float64),
                                  old_values_bt=old.astype(np.float64),
                                  returns_bt=rets.astype(np.float64))) == pytest.approx(1 / 3)
  # Loss and gradient: the float64 reference (where V_clip = V exactly inside the window).
  v64, o64, r64 = (a.astype(np.float64) for a in (values, old, rets))
  e1 = (v64 - r64) ** 2
  e2 = (o64 + np.clip(v64 - o64, -0.2, 0.2) - r64) ** 2
  assert float(loss) == pytest.approx((0.5 * np.maximum(e1, e2)).mean(), rel=1e-6)
  np.testing.assert_allclose(np.asarray(gv), np.where(e2 > e1, 0.0, (v64 - r64)) / 3, rtol=1e-5)
