"""Parquet, JSON and Hugging Face ``datasets`` folders give the same task as the equivalent JSONL file."""

import json
import sys

import pytest

from jaxrl_llm.reward_model.preferences import load_preference_jsonl
from jaxrl_llm.tasks import JsonlTask
from jaxrl_llm.tasks.rows import read_rows

datasets = pytest.importorskip("datasets")  # in the [dev] extra: present wherever the suite runs

ROWS = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}", "level": f"Level {a % 5}"}
        for a, b in ((i * 7 % 50, i * 13 % 40) for i in range(60))]


def write_all(folder, rows):
  """The same rows as JSONL, parquet, a JSON array and a save_to_disk folder."""
  jsonl = folder / "rows.jsonl"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
  ds = datasets.Dataset.from_list(rows)
  ds.to_parquet(str(folder / "rows.parquet"))
  (folder / "rows.json").write_text(json.dumps(rows))
  ds.save_to_disk(str(folder / "rows_ds"))
  return {"jsonl": str(jsonl), "parquet": str(folder / "rows.parquet"), "json": str(folder / "rows.json"),
          "folder": str(folder / "rows_ds")}


def view(task):
  train, held_out = task.examples()
  key = lambda ex: (ex.prompt, ex.answer, ex.meta["gold"], ex.meta["line"], ex.meta.get("difficulty"))  # noqa: E731
  return [key(e) for e in train], [key(e) for e in held_out], [task.train_example(3, i).prompt for i in range(150)]


def test_every_format_gives_the_jsonl_task_in_the_same_order(tmp_path):
  paths = write_all(tmp_path, ROWS)
  kwargs = dict(eval_fraction=0.2, difficulty_field="level")
  reference = view(JsonlTask(path=paths["jsonl"], **kwargs))
  assert len(reference[1]) > 0  # a held-out split exists
  for kind in ("parquet", "json", "folder"):
    assert view(JsonlTask(path=paths[kind], **kwargs)) == reference, kind
  # a held-out set in another format works as eval_path: its prompts leave the training rows
  datasets.Dataset.from_list(ROWS[:10]).save_to_disk(str(tmp_path / "held_out"))
  split = JsonlTask(path=paths["parquet"], eval_path=str(tmp_path / "held_out"))
  train, held_out = split.examples()
  left = {r["question"] for r in ROWS[10:]} - {r["question"] for r in ROWS[:10]}
  assert len(held_out) == 10 and len(train) == len(left)


def test_a_bad_row_names_the_file_and_row_whatever_the_format(tmp_path):
  rows = [dict(r) for r in ROWS[:10]]
  rows[6] = {"question": rows[6]["question"], "answer": "no final answer here", "level": "Level 1"}
  paths = write_all(tmp_path, rows)
  with pytest.raises(ValueError, match=r"rows.parquet:7: cannot extract a final answer"):
    JsonlTask(path=paths["parquet"])
  with pytest.raises(ValueError, match=r"rows_ds:7: cannot extract a final answer"):
    JsonlTask(path=paths["folder"])
  missing = [{"question": "q?", "text": "#### 1"}]
  datasets.Dataset.from_list(missing).to_parquet(str(tmp_path / "missing.parquet"))
  with pytest.raises(ValueError, match=r"missing.parquet:1: row is missing field 'answer' \(fields present: "
                                       r"\['question', 'text'\]\)"):
    JsonlTask(path=str(tmp_path / "missing.parquet"))


def test_a_folder_of_splits_a_missing_path_and_a_missing_package_are_named(tmp_path, monkeypatch):
  datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                        "test": datasets.Dataset.from_list(ROWS[4:8])}).save_to_disk(str(tmp_path / "dd"))
  with pytest.raises(ValueError, match=r"dd: a datasets folder of several splits \['test', 'train'\]; name one"):
    list(read_rows(str(tmp_path / "dd")))
  assert len(list(read_rows(str(tmp_path / "dd" / "train")))) == 4
  with pytest.raises(ValueError, match=r"nowhere.parquet: no such file or folder"):
    list(read_rows(str(tmp_path / "nowhere.parquet")))
  (tmp_path / "x.parquet").write_bytes(b"not parquet")
  with pytest.raises(ValueError, match=r"x.parquet: cannot read it as a dataset file"):
    list(read_rows(str(tmp_path / "x.parquet")))
  monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
  with pytest.raises(ValueError, match=r"needs the datasets package \(pip install 'jaxrl_llm\[data\]'\)"):
    list(read_rows(str(tmp_path / "dd" / "train")))


def test_preference_pairs_from_parquet_equal_those_from_jsonl(tmp_path):
  pairs = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
  (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
  datasets.Dataset.from_list(pairs).to_parquet(str(tmp_path / "p.parquet"))
  a = load_preference_jsonl(str(tmp_path / "p.jsonl"))
  b = load_preference_jsonl(str(tmp_path / "p.parquet"))
  assert [(p.prompt, p.chosen, p.rejected) for p in a[0]] == [(p.prompt, p.chosen, p.rejected) for p in b[0]]
