"""Tokenizers: the character tokenizer of the tiny default policy, and
`Tokenizer`, which encodes prompts (text or chat messages, through the chat
template) and decodes responses with any model directory's tokenizer.

The character tokenizer:

One token per character, built with the `tokenizers` library (nothing is
downloaded). Ids are fixed:

  0 `<pad>`, 1 `<bos>`, 2 `<eos>`, 3 `<unk>`, then `CHARS` in order, then
  `<unusedK>` fillers up to `VOCAB_SIZE` (64) so the tiny model's embedding
  table has a round size.

`encode` adds no special tokens and refuses characters outside the vocabulary
(a silent `<unk>` would make a synthetic task unlearnable without anyone
noticing). `save_hf_tokenizer` writes the files `transformers.AutoTokenizer`
and vLLM need; the saved tokenizer prepends `<bos>` when asked to add special
tokens, which matches `make_prompts` in `streamrl/data/loader.py`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from streamrl.errors import UserError

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Everything the synthetic tasks use, plus a few symbols for small variations.
# No '<' or '>': they would make text like "<eos>" ambiguous.
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz :=+-,()[]./*|#"
VOCAB_SIZE = 64

_NUM_REAL = len(SPECIAL_TOKENS) + len(CHARS)
assert _NUM_REAL <= VOCAB_SIZE, "CHARS no longer fits in VOCAB_SIZE"
assert len(set(CHARS)) == len(CHARS), "CHARS has duplicates"


def vocab() -> dict[str, int]:
  """Returns the full token -> id map (VOCAB_SIZE entries)."""
  tokens = list(SPECIAL_TOKENS) + list(CHARS)
  tokens += [f"<unused{k}>" for k in range(VOCAB_SIZE - len(tokens))]
  return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> tokenizers.Tokenizer:
  """Builds the character tokenizer as a `tokenizers.Tokenizer`.

  Its `encode(text)` prepends `<bos>` by default (post-processor), like the
  saved HF tokenizer; use `encode(text, add_special_tokens=False)` or this
  module's `encode` for the bare character ids.
  """
  tok = tokenizers.Tokenizer(models.WordLevel(vocab(), unk_token=UNK_TOKEN))
  # Every character is its own word; Split with an always-matching regex
  # keeps spaces as tokens (Whitespace pre-tokenizers would drop them).
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  # Fuse joins tokens without the space WordLevel would put between them.
  tok.decoder = decoders.Fuse()
  special = [
      tokenizers.AddedToken(t, special=True, normalized=False) for t in vocab() if t.startswith("<")
  ]
  tok.add_special_tokens(special)
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS_TOKEN} $A",
      pair=f"{BOS_TOKEN} $A $B:1",
      special_tokens=[(BOS_TOKEN, BOS_ID)],
  )
  return tok


@functools.cache
def _char_to_id() -> dict[str, int]:
  return {c: i for c, i in vocab().items() if len(c) == 1}


@functools.cache
def _id_to_char() -> dict[int, str]:
  return {i: c for c, i in _char_to_id().items()}


def encode(text: str) -> list[int]:
  """Maps each character of `text` to its id; no special tokens are added.

  Raises ValueError naming the characters that are not in the vocabulary.
  """
  table = _char_to_id()
  try:
    return [table[c] for c in text]
  except KeyError:
    bad = sorted({c for c in text if c not in table})
    raise ValueError(
        f"Text {text[:40]!r} has characters {bad} that the character "
        f"tokenizer does not know; use only characters from {CHARS!r}."
    ) from None


def decode(ids: Iterable[int]) -> str:
  """Turns ids back into text.

  Stops at the first `<eos>`; drops `<pad>`, `<bos>` and other non-character
  ids (a sampled `<unused3>` says nothing about the answer, so it is skipped
  rather than raising).
  """
  table = _id_to_char()
  out = []
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    c = table.get(i)
    if c is not None:
      out.append(c)
  return "".join(out)


def save_hf_tokenizer(directory: str | os.PathLike, *, model_max_length: int = 4096) -> str:
  """Writes tokenizer.json, tokenizer_config.json, special_tokens_map.json.

  `transformers.AutoTokenizer.from_pretrained(directory)` then loads a fast
  tokenizer with the same ids, bos/eos/pad/unk set. Returns `directory`.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  build_tokenizer().save(os.path.join(directory, "tokenizer.json"))
  special_map = {
      "bos_token": BOS_TOKEN,
      "eos_token": EOS_TOKEN,
      "pad_token": PAD_TOKEN,
      "unk_token": UNK_TOKEN,
  }
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "model_max_length": model_max_length,
      "add_bos_token": True,
      "add_eos_token": False,
      "clean_up_tokenization_spaces": False,
      "padding_side": "left",
      **special_map,
  }
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
    json.dump(special_map, f, indent=2)
  return directory


CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# A chat template for tokenizers that ship none: BOS, then each turn `<|role|>`
# and its content, ended by the tokenizer's EOS (so the assistant's turn ends
# where generation stops), then the assistant's header as the generation prompt.
TURNS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Qwen2's ChatML layout (`<|im_start|>role\n...`, no BOS) for a vocabulary
# without ChatML's special tokens: the markers are plain text, and each turn
# ends with the tokenizer's EOS where Qwen2 writes `<|im_end|>` (its EOS).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _cache_dir() -> str:
  return os.environ.get("STREAMRL_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "streamrl"
  )


def save_sentencepiece_tokenizer(
    directory: str | os.PathLike,
    model_file: str | None = None,
    *,
    chat_template: str | None = TURNS_TEMPLATE,
) -> str:
  """Writes a real SentencePiece tokenizer as an HF tokenizer directory
  (tokenizer.model, tokenizer.json, tokenizer_config.json, the chat
  template). `model_file` defaults to the 32,000-piece Llama/Mistral model
  `mistral-common` ships (installed with vLLM); `transformers` converts it to
  tokenizer.json offline (several seconds), once per model file and template:
  the result is kept in $STREAMRL_CACHE (default ~/.cache/streamrl) and
  copied from there. Returns `directory`."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top

  if model_file is None:
    import mistral_common  # pylint: disable=g-import-not-at-top

    model_file = os.path.join(
        os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1"
    )
  directory = os.fspath(directory)
  with open(model_file, "rb") as f:
    key = hashlib.sha256(f.read() + repr(chat_template).encode()).hexdigest()[:16]
  cached = os.path.join(_cache_dir(), f"sentencepiece-{key}")
  if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
    tmp = f"{cached}.tmp{os.getpid()}"
    _convert_sentencepiece(model_file, tmp, chat_template)
    try:
      os.replace(tmp, cached)  # Atomic: another process may have won the race.
    except OSError:
      shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(directory, exist_ok=True)
  for name in os.listdir(cached):
    shutil.copyfile(os.path.join(cached, name), os.path.join(directory, name))
  return directory


def _convert_sentencepiece(model_file: str, directory: str, chat_template: str | None) -> None:
  import shutil  # pylint: disable=g-import-not-at-top

  import transformers  # pylint: disable=g-import-not-at-top

  os.makedirs(directory, exist_ok=True)
  shutil.copyfile(model_file, os.path.join(directory, "tokenizer.model"))
  config = {
      "tokenizer_class": "LlamaTokenizer",
      "bos_token": "<s>",
      "eos_token": "</s>",
      "unk_token": "<unk>",
      "add_bos_token": True,
      "add_eos_token": False,
      "legacy": False,
  }
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  hf = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
  if chat_template is not None:
    hf.chat_template = chat_template
  hf.save_pretrained(directory)


def read_chat_template(model_dir: str) -> str | None:
  """The chat template a tokenizer directory ships (chat_template.jinja, or
  tokenizer_config.json's `chat_template`: a string, or a list of named
  templates whose `default` is used), None without one."""
  path = os.path.join(model_dir, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  path = os.path.join(model_dir, "tokenizer_config.json")
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    template = json.load(f).get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return template if isinstance(template, str) and template.strip() else None


# The named special tokens a chat template sees as variables, as transformers' tokenizers pass them.
_TEMPLATE_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def template_tokens(model_dir: str) -> dict[str, str]:
  """{"bos_token": "<s>", ...}: the named special tokens of a tokenizer
  directory (tokenizer_config.json's, special_tokens_map.json's winning), each
  as its text; those it does not name are left out."""
  out = {}
  for name in ("tokenizer_config.json", "special_tokens_map.json"):
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
    for key in _TEMPLATE_TOKENS:
      token = config.get(key)
      token = token.get("content") if isinstance(token, dict) else token
      if isinstance(token, str):
        out[key] = token
  return out


def stop_token_ids(model_dir: str) -> list[int]:
  """Token ids that end a sample: generation_config.json's `eos_token_id` (an
  id or a list: Instruct models stop at their end-of-turn token too), then
  config.json's, without repeats."""
  out: list[int] = []
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      eos = json.load(f).get("eos_token_id")
    for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
      if isinstance(i, int) and i not in out:
        out.append(i)
  return out


class Tokenizer:
  """Prompts to token ids and responses to text, with a model directory's
  tokenizer.

  Plain-text prompts are encoded with the model's own special tokens (BOS
  where the model adds one). With a chat template (`chat_template`: "auto"
  uses the tokenizer's when it has one, "on" requires it, "off" never uses
  it), a prompt — text, or a list of `{"role", "content"}` messages — is
  rendered as a conversation (a text prompt is the user's turn, led by
  `system_prompt` when given) ending in the assistant's generation prompt,
  and the rendering is encoded as it stands (the template writes its own
  special tokens); `chat_template_kwargs` are the template's extra variables
  (`task.chat_template_kwargs`). `tokenizer.json` is read with the `tokenizers` library;
  `transformers` (its tokenizer classes: SentencePiece-only directories,
  the template's Jinja environment) is loaded only when needed.
  """

  def __init__(
      self,
      model_dir: str,
      *,
      chat_template: str = "auto",
      system_prompt: str = "",
      chat_template_kwargs: dict | None = None,
  ):
    if chat_template not in CHAT_TEMPLATE_MODES:
      raise UserError(
          f"task.chat_template={chat_template!r} is unknown; use one of {CHAT_TEMPLATE_MODES}."
      )
    self.model_dir = model_dir
    self.system_prompt = system_prompt
    self.chat_template_kwargs = dict(chat_template_kwargs or {})
    path = os.path.join(model_dir, "tokenizer.json")
    self._fast = tokenizers.Tokenizer.from_file(path) if os.path.isfile(path) else None
    self._hf = None
    self._template = read_chat_template(model_dir)
    self._template_vars = None  # its named special tokens and chat_template_kwargs (`render`)
    has_template = self._template is not None
    if chat_template == "on" and not has_template:
      raise UserError(
          f"task.chat_template='on' but the tokenizer in {model_dir!r} has no chat template; "
          "add one to its tokenizer_config.json (or chat_template.jinja), or set "
          "task.chat_template=off."
      )
    self.chat = has_template and chat_template != "off"
    if system_prompt and not self.chat:
      raise UserError(
          "task.system_prompt needs a chat template, and this run renders none; use a "
          "tokenizer with one (task.chat_template=auto/on) or leave task.system_prompt empty."
      )
    if self._fast is None:
      self._load_hf()

  def _load_hf(self):
    if self._hf is None:
      import transformers  # pylint: disable=g-import-not-at-top

      try:
        self._hf = transformers.AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
      except Exception as err:  # pylint: disable=broad-except
        raise UserError(
            f"No tokenizer could be loaded from {self.model_dir!r} ({type(err).__name__}: "
            f"{err}); save the model's tokenizer there (tokenizer.save_pretrained)."
        ) from None
    return self._hf

  def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
    if self._fast is not None:
      return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
    return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

  def messages(self, prompt) -> list[dict]:
    """The conversation a prompt stands for (a text prompt: the user's turn)."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
      msgs.insert(0, {"role": "system", "content": self.system_prompt})
    return msgs

  def render(self, messages, *, add_generation_prompt: bool = True) -> str:
    """The chat template's text for a conversation (`chat_template_kwargs`,
    e.g. Qwen3's `enable_thinking`, reach the template as variables)."""
    if self._template is not None:
      # transformers' own Jinja rendering, without its tokenizer classes: loading
      # those imports torch, which the trainer's process must not hold.
      from transformers.utils import chat_template_utils  # pylint: disable=g-import-not-at-top

      if self._template_vars is None:  # read once, not per prompt
        self._template_vars = {**template_tokens(self.model_dir), **self.chat_template_kwargs}
      variables = self._template_vars
      rendered, _ = chat_template_utils.render_jinja_template(
          conversations=[list(messages)],
          chat_template=self._template,
          add_generation_prompt=add_generation_prompt,
          **variables,
      )
      return rendered[0]
    return self._load_hf().apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **self.chat_template_kwargs,
    )

  def encode_prompt(self, prompt) -> list[int]:
    """Token ids of a prompt (text, or chat messages), ready to generate from."""
    if self.chat:
      return self._encode(self.render(self.messages(prompt)), add_special_tokens=False)
    if not isinstance(prompt, str):
      raise UserError(
          "A prompt is a list of chat messages but no chat template renders it; use a "
          "tokenizer with a chat template (task.chat_template=auto/on) or text prompts."
      )
    return self._encode(prompt, add_special_tokens=True)

  def turn_tokens(
      self, messages, message: dict, *, add_generation_prompt: bool = True
  ) -> list[int]:
    """Token ids one more turn adds after a conversation, without encoding the
    conversation again: the template's text for `messages + [message]` (with
    the next generation prompt) past its text for `messages`, encoded alone.
    Raises ValueError when the template rewrites earlier turns (the longer
    rendering does not start with the shorter one)."""
    before = self.render(messages, add_generation_prompt=False)
    after = self.render(list(messages) + [message], add_generation_prompt=add_generation_prompt)
    if not after.startswith(before):
      raise ValueError(
          "The chat template renders the earlier turns differently once a turn is added; "
          "appending tokens would drift from a re-rendering of the conversation."
      )
    return self._encode(after[len(before) :], add_special_tokens=False)

  def encode_text(self, text: str) -> list[int]:
    """Token ids of `text` as it stands, no special tokens added (an observation, a stop string)."""
    return self._encode(text, add_special_tokens=False)

  def decode(self, ids: Sequence[int]) -> str:
    if self._fast is not None:
      return self._fast.decode(list(ids), skip_special_tokens=True)
    return self._hf.decode(list(ids), skip_special_tokens=True)
