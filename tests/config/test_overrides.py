"""Overrides of a run config: parsed by field type, refused in one sentence, strictly typed."""

import pytest

from streamrl.config import apply_overrides
from streamrl.config.checks import coerce
from streamrl.errors import UserError

pytestmark = [pytest.mark.unit]

CONFIG_PY = """
import ml_collections
def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.trainer = ml_collections.ConfigDict()
  c.trainer.lr = 1e-6
  c.trainer.num_iterations = 10
  c.trainer.mesh = (1, 8)
  c.algo = ml_collections.ConfigDict()
  c.algo.name = "ppo"
  c.algo.kl_coef = 0.0
  c.algo.use_critic = True
  c.data = ml_collections.ConfigDict()
  c.data.path = ml_collections.FieldReference(None, field_type=str)
  if arg == "tiny":
    c.trainer.num_iterations = 2
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; use cfg.py or cfg.py:tiny.")
  return c
"""

SWEEP_PY = """
def get_sweep(arg=None):
  return [{"trainer.lr": [1e-6, 3e-6], "algo.kl_coef": [0.0, 0.01]}, {"algo.name": "grpo", "trainer.mesh": (2, 4)}]
"""


def _config():
  ns = {}
  exec(CONFIG_PY, ns)  # pylint: disable=exec-used
  return ns["get_config"]()


def test_apply_overrides_parses_by_field_type_and_copies():
  base = _config()
  base.lock()
  c = apply_overrides(
      base,
      [
          "trainer.lr=3e-6",
          "trainer.num_iterations=4",
          "trainer.mesh=(2, 4)",
          "algo.use_critic=false",
          "algo.name=grpo",
          "data.path=/tmp/x.jsonl",
          "seed=7",
      ],
  )
  assert (c.trainer.lr, c.trainer.num_iterations, c.trainer.mesh) == (3e-6, 4, (2, 4))
  assert (c.algo.use_critic, c.algo.name, c.data.path, c.seed) == (False, "grpo", "/tmp/x.jsonl", 7)
  assert isinstance(c.trainer.lr, float)
  assert base.trainer.lr == 1e-6 and base.data.path is None  # Untouched.
  assert apply_overrides(base, ["trainer.lr=1"]).trainer.lr == 1.0  # An int is a fine float.
  assert apply_overrides(base, ["trainer.mesh=8"]).trainer.mesh == (8,)  # Like config_flags.
  # Mappings carry Python values (sweeps); strings for non-string fields are parsed.
  c = apply_overrides(base, {"trainer.lr": 2e-6, "trainer.mesh": [4, 2], "algo.kl_coef": "0.05"})
  assert (c.trainer.lr, c.trainer.mesh, c.algo.kl_coef) == (2e-6, (4, 2), 0.05)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "unknown config key 'trainer.lrr'; did you mean trainer.lr?"),
        ("traner.lr=1", "unknown config key 'traner.lr'; did you mean trainer.lr?"),
        (
            "num_iterations=1",
            "unknown config key 'num_iterations'; did you mean trainer.num_iterations?",
        ),
        (
            "trainer.zzz=1",
            "unknown config key 'trainer.zzz'; the keys under trainer are: lr, mesh, num_iterations.",
        ),
        (
            "trainer.lr.x=1",
            "unknown config key 'trainer.lr.x'; trainer.lr is a value, not a group of keys.",
        ),
        ("trainer.lr=abc", "cannot set trainer.lr to 'abc': it expects a float (currently 1e-06)."),
        (
            "trainer.num_iterations=1.5",
            "cannot set trainer.num_iterations to '1.5': it expects an int (currently 10).",
        ),
        ("algo.use_critic=maybe", "cannot set algo.use_critic to 'maybe': it expects a bool"),
        ("trainer.lr", "override 'trainer.lr' must look like key=value"),
    ],
)
def test_apply_overrides_rejects_with_one_sentence(override, message):
  with pytest.raises(UserError) as e:
    apply_overrides(_config(), [override])
  assert str(e.value).startswith(message)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"trainer.num_iterations": 1.5}, "it expects an int"),
        ({"trainer.lr": True}, "it expects a float"),
        ({"algo.use_critic": 1}, "it expects a bool"),
        ({"algo.name": 3}, "it expects a string"),
        ({"trainer.mesh": 3}, "it expects a tuple"),
    ],
)
def test_typed_overrides_are_strict(overrides, message):
  with pytest.raises(UserError, match=message):
    apply_overrides(_config(), overrides)


def test_one_strict_type_check_serves_the_settings_and_the_overrides():
  assert coerce(1, float) == 1.0 and isinstance(coerce(1, "float"), float)
  assert coerce([1, 8], "tuple") == (1, 8)
  assert coerce({"a": 1}, dict) == {"a": 1}  # other types: ConfigDict's own check decides
  for value, want in [(True, int), (True, float), (1.5, int), (1, bool), (3, str), (3, tuple)]:
    with pytest.raises(TypeError):
      coerce(value, want)
