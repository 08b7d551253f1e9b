"""Tokenizer wrapper, chat templates, char tokenizers and sampler/learner fingerprints."""

import datetime
import json
import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxrl_llm.bridge import fingerprint as fp
from jaxrl_llm.bridge.chat_template import ChatTemplateError, render_chat_template
from jaxrl_llm.bridge.tokenizer import Tokenizer, build_char_tokenizer
from jaxrl_llm.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

ALPHABET = "0123456789+=- "

CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if tools %}{{- '<|im_start|>tools\\n' + tools | tojson(indent=2) + '<|im_end|>\\n' }}{% endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- endif %}")

LOOPS = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + eos_token }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}")

MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "  What is 2+2? "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3 (café)?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Addition é",
                                           "parameters": {"a": "int", "b": "int"}}}]


def make_bpe_tokenizer(pad_token=None, extra_specials=("<|fim_pad|>",)):
  """A small byte-level BPE with ChatML specials (a Qwen-like tokenizer)."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = [m["content"] for m in MESSAGES] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
  tok.train_from_iterator(corpus, trainer)
  return Tokenizer(tok, chat_template=CHATML, eos_token="<|im_end|>", pad_token=pad_token,
                   source="test bpe", strict_pad=False)


# ----------------------------------------------------------------- char tokenizer


def test_char_tokenizer_ids_and_round_trip():
  tok = build_char_tokenizer(ALPHABET)
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  assert tok.vocab_size == 3 + len(ALPHABET) and tok.is_char_level and tok.unk_token is None
  assert tok.encode("0") == [3] and tok.encode(" ") == [3 + ALPHABET.index(" ")]
  ids = tok.encode("12+34=46<eos>")
  assert ids[-1] == 1 and len(ids) == 9
  assert tok.decode(ids) == "12+34=46<eos>"
  assert tok.decode(ids, skip_special_tokens=True) == "12+34=46"
  assert tok.encode_batch(["1", "<bos>2-3"]) == [[4], [2, 5, 3 + ALPHABET.index("-"), 6]]
  assert tok.decode_batch([[4, 1], [0, 0]], skip_special_tokens=True) == ["1", ""]
  with pytest.raises(ValueError, match="character 'x'"):
    tok.encode("1x")
  with pytest.raises(ValueError, match="id 99 is outside"):
    tok.decode([99])


def test_saved_char_tokenizer_marks_unknown_characters_instead_of_dropping_them(tmp_path):
  """``transformers`` loads the saved folder: a character outside the alphabet becomes <unk>, in place."""
  transformers = pytest.importorskip("transformers")
  tok = build_char_tokenizer(ALPHABET, unk_token="<unk>")
  assert tok.vocab_size == 3 + len(ALPHABET) + 1 and tok.unk_token == "<unk>"
  tok.save(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  unk = tok.token_to_id("<unk>")
  assert unk == 3 + len(ALPHABET)
  assert hf("1x2", add_special_tokens=False).input_ids == [4, unk, 5]
  assert hf.unk_token == "<unk>" and len(hf) == tok.vocab_size
  with pytest.raises(ValueError, match="character 'x'"):  # our own encoder still refuses it
    Tokenizer.from_folder(tmp_path).encode("1x2")


def test_char_fast_path_agrees_with_tokenizers_library():
  tok = build_char_tokenizer(ALPHABET)
  rng = random.Random(0)
  pieces = list(ALPHABET) + ["<eos>", "<bos>", "<pad>", "<", ">", "eos"]
  pieces = [p for p in pieces if all(c in ALPHABET for c in p) or p.startswith("<") and p.endswith(">")]
  for _ in range(300):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
    ids = tok.encode(text)
    assert ids == tok.backend.encode(text).ids, text
    assert tok.decode(ids) == tok.backend.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == tok.backend.decode(ids, skip_special_tokens=True)


def test_char_tokenizer_argument_errors():
  with pytest.raises(ValueError, match="repeats the character '1'"):
    build_char_tokenizer("121")
  with pytest.raises(ValueError, match="duplicate special"):
    build_char_tokenizer("12", special=("<pad>", "<pad>"))
  with pytest.raises(ValueError, match="also alphabet characters"):
    build_char_tokenizer("ab", special=("a", "<eos>"))


def test_char_tokenizer_save_load_and_transformers_agree(tmp_path):
  tok = build_char_tokenizer(ALPHABET)
  tok.save(tmp_path)
  back = Tokenizer.from_folder(tmp_path)
  assert back.is_char_level
  assert (back.pad_id, back.eos_id, back.bos_id) == (0, 1, 2)
  assert back.fingerprint() == tok.fingerprint()
  assert back.encode("9-8= 1") == tok.encode("9-8= 1")
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (0, 1, 2)
  for text in ["12+34=46<eos>", "  7-1", "<bos>3"]:
    assert hf(text)["input_ids"] == tok.encode(text)
  messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
  rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
  assert rendered == "<bos>1+2=3<eos>"
  assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  assert tok.apply_chat_template(messages[:1], tokenize=True) == [2, 4, 13, 5, 14]


# ------------------------------------------------------------- chat templates


@pytest.mark.parametrize("template", [CHATML, LOOPS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tmp_path, template, add_generation_prompt):
  tok = make_bpe_tokenizer()
  tok.chat_template = template
  tok.bos_token = "<|endoftext|>"
  tok.save(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs)
    theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt,
                                    **kwargs)
    assert ours == theirs, kwargs
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  **kwargs)
    assert ids == hf(theirs, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == theirs
  if template == CHATML:
    assert '"description": "Addition é"' in tok.apply_chat_template(MESSAGES, tools=TOOLS)


def test_chat_template_errors():
  tok = make_bpe_tokenizer()
  with pytest.raises(ChatTemplateError, match="unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="syntax error"):
    render_chat_template("{% for %}", MESSAGES)
  with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
    render_chat_template(CHATML, ["hello"])
  tok.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(MESSAGES)
  assert render_chat_template("{{ strftime_now('%Y') }}", []) == str(datetime.date.today().year)


def test_template_files_and_special_token_dicts(tmp_path):
  tok = make_bpe_tokenizer()
  tok.save(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": LOOPS}]
  config["eos_token"] = {"content": "<|im_end|>", "special": True}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  back = Tokenizer.from_folder(tmp_path)
  assert back.chat_template == LOOPS and back.eos_token == "<|im_end|>"
  (tmp_path / "chat_template.jinja").write_text(CHATML)   # transformers 5 layout wins
  assert Tokenizer.from_folder(tmp_path).chat_template == CHATML


# ---------------------------------------------------------------------- pad id


def test_pad_rules_never_conflate_pad_and_eos(tmp_path):
  tok = make_bpe_tokenizer(pad_token="<|im_end|>")          # declared pad == eos: fall back
  assert tok.pad_token == "<|fim_pad|>" and tok.pad_id != tok.eos_id
  tok = make_bpe_tokenizer(pad_token="<|endoftext|>")       # distinct declared pad is kept
  assert tok.pad_id == tok.token_to_id("<|endoftext|>")
  tok = make_bpe_tokenizer(extra_specials=())               # no pad-like special: highest free id
  assert tok.pad_id == tok.vocab_size - 1 != tok.eos_id
  tok = make_bpe_tokenizer()
  tok.save(tmp_path)
  with pytest.raises(ValueError, match="has the EOS id"):
    Tokenizer.from_folder(tmp_path, pad_token="<|im_end|>")
  assert Tokenizer.from_folder(tmp_path, pad_token="<|endoftext|>").pad_token == "<|endoftext|>"
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["eos_token"] = None
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="no eos_token"):
    Tokenizer.from_folder(tmp_path)


# ----------------------------------------------------------------- fingerprints


def _config(**kw):
  base = dict(family="qwen2", vocab_size=320, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
              num_kv_heads=1, pad_token_id=0, eos_token_id=1)
  base.update(kw)
  return ModelConfig(**base)


def test_fingerprint_is_stable_and_sensitive(tmp_path):
  tok = build_char_tokenizer(ALPHABET)
  digest = tok.fingerprint()
  assert len(digest) == 64 and int(digest, 16) >= 0
  assert build_char_tokenizer(ALPHABET).fingerprint() == digest
  assert build_char_tokenizer(ALPHABET[::-1]).fingerprint() != digest
  assert build_char_tokenizer(ALPHABET, chat_template="{{ messages[0].content }}").fingerprint() != digest
  tok.save(tmp_path)
  assert Tokenizer.from_folder(tmp_path).fingerprint() == digest
  assert Tokenizer.from_folder(tmp_path, pad_token="9").fingerprint() != digest


def test_model_fingerprint_scope():
  config = _config()
  base = fp.model_fingerprint(config)
  assert fp.model_fingerprint(config.replace(param_dtype="float32", dtype="float32", remat=True,
                                             value_head=True)) == base
  assert fp.model_fingerprint(config.replace(rope_theta=1e6)) != base
  assert fp.model_fingerprint(config, revision="abc") != base
  from jaxrl_llm.bridge.hf_config import config_to_hf
  assert fp.model_fingerprint(config_to_hf(config)) == base


def test_check_fingerprints_names_each_differing_part(tmp_path):
  learner = fp.make_fingerprint(build_char_tokenizer(ALPHABET), _config(), revision="v1")
  same = fp.make_fingerprint(build_char_tokenizer(ALPHABET), _config(), revision="v1")
  fp.check_fingerprints(learner, same)
  assert fp.Fingerprint.from_dict(json.loads(json.dumps(learner.to_dict()))) == learner
  assert learner.digest() == same.digest()

  cases = {
      ("tokenizer",): fp.make_fingerprint(build_char_tokenizer(ALPHABET + "*"), _config(), "v1"),
      ("chat_template",): fp.make_fingerprint(build_char_tokenizer(ALPHABET, chat_template="x"), _config(), "v1"),
      ("special_ids",): fp.make_fingerprint(Tokenizer.from_folder(build_char_tokenizer(ALPHABET).save(tmp_path),
                                                                  pad_token="7"), _config(), "v1"),
      ("model",): fp.make_fingerprint(build_char_tokenizer(ALPHABET), _config(), "v2"),
      ("tokenizer", "model"): fp.make_fingerprint(build_char_tokenizer("01"), _config(num_layers=2), "v1"),
  }
  labels = {"tokenizer": "tokenizer differs", "chat_template": "chat template differs",
            "special_ids": "special token ids differs", "model": "model config/revision differs"}
  for parts, sampler in cases.items():
    with pytest.raises(fp.FingerprintMismatchError) as info:
      fp.check_fingerprints(learner, sampler)
    assert tuple(info.value.parts) == parts
    message = str(info.value)
    assert message.startswith("learner and sampler disagree")
    for part, label in labels.items():
      assert (label in message) == (part in parts), (parts, message)


def test_tokenizer_config_agreement():
  tok = build_char_tokenizer(ALPHABET)
  fp.check_tokenizer_matches_config(tok, _config(vocab_size=32, bos_token_id=2))
  fp.check_tokenizer_matches_config(tok, _config(vocab_size=32))            # config without bos: fine
  with pytest.raises(ValueError, match="pad: tokenizer 0, ModelConfig 5"):
    fp.check_tokenizer_matches_config(tok, _config(vocab_size=32, pad_token_id=5))
  with pytest.raises(ValueError, match="ModelConfig.vocab_size is 8"):
    fp.check_tokenizer_matches_config(tok, _config(vocab_size=8))


def test_sampled_ids_past_the_tokenizer_decode_to_nothing_in_a_job():
  """A model's padded embedding rows (vocab_size > the tokenizer's) can be sampled; the job's
  decoding drops them instead of stopping the run (the tokenizer's own decode stays strict)."""
  import types

  from jaxrl_llm.jobs.base import Job
  tok = build_char_tokenizer("0123456789+=")
  ids = tok.encode("12") + [tok.vocab_size, tok.vocab_size + 40] + tok.encode("3")
  assert Job.decode_response(types.SimpleNamespace(tokenizer=tok), ids) == "123"
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode(ids)
