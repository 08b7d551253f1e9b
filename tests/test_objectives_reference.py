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


def ref_cispo(x, f, eps_high=0.1, weight_x=None):
  """CISPO; ``weight_x`` freezes the IS weight at another point (the stop-gradient)."""
  m = f["mask_bt"]
  xx, a = z(x, m), z(f["advantages_bt"], m)
  xw = xx if weight_x is None else z(weight_x, m)
  w = np.clip(np.exp(xw - z(f["behaviour_logp_bt"], m)), 0.0, 1.0 + eps_high)
  return token_mean(-w * a * xx, -w * a, m)


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


CASES = {
    # name: (objective, reference, input fields used, prox given)
    "ppo": (O.recipes.ppo(), ref_ppo,
            ("values_bt", "old_values_bt", "returns_bt"), False),
    "grpo": (O.recipes.grpo(), ref_grpo, ("ref_logp_bt",), False),
    "dr_grpo": (O.recipes.dr_grpo(C), ref_dr_grpo, (), False),
    "dapo": (O.recipes.dapo(), ref_dapo, (), False),
    "cispo": (O.recipes.cispo(0.1), ref_cispo, (), False),
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
  if name == "cispo":
    loss_fn = lambda x: ref_cispo(x, f64, weight_x=x64)
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
