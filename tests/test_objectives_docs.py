"""docs/objectives.md: its worked example runs, every transform is documented, quoted signatures match the code."""

import ast
import inspect
import pathlib
import re

from jaxrl_llm import objectives as O

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "objectives.md"


def python_blocks(text):
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_worked_example_runs():
  blocks = python_blocks(DOC.read_text())
  assert len(blocks) == 1, "docs/objectives.md should hold exactly one python example"
  namespace = {}
  exec(compile(blocks[0], str(DOC), "exec"), namespace)  # the block asserts its results
  metrics = namespace["metrics"]
  assert float(metrics["all_masked"]) == 0.0 and float(metrics["tokens"]) > 0


def test_every_transform_and_mode_has_a_row():
  text = DOC.read_text()
  for name in ("ppo_clip", "dual_clip", "cispo", "gspo", "decoupled", "geppo_adaptive",
               "truncated_is", "masked_is", "staleness_filter", "segment_is", "entropy_bonus",
               "kl_loss", "sft_loss", "value_loss", "critic_warmup", "aggregate"):
    assert hasattr(O, name)
    row = re.search(rf"^\| `{name}\(.*$", text, re.M)
    assert row, f"no table row for {name}"
    assert "arXiv:" in row.group(0) or "seed document" in row.group(0) or name == "aggregate"
  for mode in O.AGGREGATIONS:
    assert f"| `{mode}`" in text


def quoted_calls(text):
  """``(name, argument list)`` of every `name(args)` code span and every ``O.name(...)`` call in the python block."""
  calls = re.findall(r"`([A-Za-z_][\w.]*)\(([^`()]*)\)`", text)
  for block in python_blocks(text):
    for node in ast.walk(ast.parse(block)):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        if node.func.value.id == "O":
          calls.append((node.func.attr, ", ".join(f"{k.arg}=..." for k in node.keywords if k.arg)))
  return calls


def documented_callable(name):
  """The objectives-library callable a doc names (``recipes.grpo``, ``kl_loss``, ...), or None."""
  obj = O
  for part in name.split("."):
    obj = getattr(obj, part, None)
  return obj if callable(obj) else None


def test_quoted_signatures_use_the_real_parameter_names():
  """Every `name(a, b)` / `name(k=v)` quoted in docs/objectives.md names parameters the code has."""
  checked = 0
  for name, args in quoted_calls(DOC.read_text()):
    fn = documented_callable(name)
    if fn is None:
      continue  # formulas such as `max(., c A)` and other libraries' calls
    params = inspect.signature(fn).parameters
    star = {f"*{n}" for n, p in params.items() if p.kind is inspect.Parameter.VAR_POSITIONAL}
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for arg in (a.strip() for a in args.split(",") if a.strip()):
      written = arg.split("=")[0].strip() if "=" in arg else arg
      if not re.fullmatch(r"\*?[A-Za-z_]\w*", written) or ("=" in arg and any_keyword):
        continue  # a literal value, e.g. recipe("dapo"), or a keyword that **kwargs takes
      assert written in params or written in star, f"docs/objectives.md: `{name}({args})`: {written!r} is not a " \
          f"parameter of {name}{inspect.signature(fn)}"
      checked += 1
  assert checked > 30
