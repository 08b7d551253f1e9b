"""docs/config.md is generated from the settings declarations and cannot go stale."""

import inspect

from jaxrl_llm import configuration, objectives, tasks
from jaxrl_llm.configuration import reference
from jaxrl_llm.settings import config_fields


def test_docs_config_md_is_the_generated_reference():
  text = reference.DOC_PATH.read_text(encoding="utf-8") if reference.DOC_PATH.is_file() else ""
  assert text == reference.render(), f"docs/config.md is stale; regenerate it with: {reference.COMMAND}"


def test_reference_lists_every_field_recipe_and_task():
  text = reference.render()
  config = configuration.base_config()
  for part in configuration.schema.parts():
    for f in config_fields(part.cls):
      assert f.metadata.get("doc"), f"{part.section}.{f.name} has no one-line meaning"
      assert f"| `{f.name}` |" in text
  for section in configuration.schema.sections():
    assert section == "" or f"### `{section}`" in text
  for path in ("rollout.actor_cpus", "learner.max_nonfinite_in_a_row", "init.tokenizer", "data.min_attempts"):
    section, name = path.split(".")
    block = text.split(f"### `{section}`")[1].split("\n### ")[0]
    assert f"| `{name}` |" in block and repr(configuration.get_field(config, path)) in block, path
  for name, fn in objectives.RECIPES.items():
    block = text.split(f"### `{name}`")[1].split("\n### ")[0]
    assert inspect.getdoc(fn).splitlines()[0] in block
    for pname in reference.parameters(fn):
      assert f"| `{pname}` |" in block, (name, pname)
  for name in tasks.list_tasks():
    block = text.split(f"### `{name}`")[1].split("\n### ")[0]
    for pname, p in reference.parameters(tasks.task_factory(name)).items():
      assert f"| `{pname}` |" in block and repr(p.default) in block, (name, pname)
