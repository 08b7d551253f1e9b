"""docs/objectives.md: its worked example runs, and every transform is documented."""

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
