"""Sweeps: the grid's points in order, their run names, and a config file's get_sweep()."""

import pytest

from streamrl.config import check_run_names, expand_sweep, load_sweep, run_name
from streamrl.errors import MissingFileError, UserError
from tests.config.test_overrides import CONFIG_PY, SWEEP_PY

pytestmark = [pytest.mark.unit]


def test_expand_sweep_grid_order_and_fixed_values():
  points = expand_sweep([{"a": [1, 2], "b": ["x", "y"], "mesh": (2, 4)}, {"a": 3}])
  assert points == [
      {"a": 1, "b": "x", "mesh": (2, 4)},
      {"a": 1, "b": "y", "mesh": (2, 4)},
      {"a": 2, "b": "x", "mesh": (2, 4)},
      {"a": 2, "b": "y", "mesh": (2, 4)},
      {"a": 3},
  ]
  assert expand_sweep({"a": [1, 2]}) == [{"a": 1}, {"a": 2}]
  for bad, message in [
      ([], "non-empty list"),
      ([{"a": []}], "empty list"),
      ([3], "must be a dict"),
      ([{1: 2}], "dotted config names"),
  ]:
    with pytest.raises(UserError, match=message):
      expand_sweep(bad)


def test_run_name_is_readable_safe_and_deterministic():
  assert (
      run_name({"trainer.lr": 3e-6, "algo.kl_coef": 0.01}) == "trainer.lr=3e-06,algo.kl_coef=0.01"
  )
  assert (
      run_name({"trainer.mesh": (2, 4), "algo.use_critic": False})
      == "trainer.mesh=2_4,algo.use_critic=False"
  )
  assert run_name({}) == "base"
  # Unsafe characters are replaced, and a hash keeps the names distinct.
  a, b = run_name({"data.path": "/a/b c"}), run_name({"data.path": "_a_b_c"})
  assert a.startswith("data.path=_a_b_c-") and b == "data.path=_a_b_c" and a != b
  assert "/" not in a and " " not in a
  long = {f"group.key_{i}": 1e-6 * i for i in range(40)}
  name = run_name(long)
  assert len(name) == 120 and name == run_name(dict(long))
  assert name != run_name({**long, "group.key_39": 1.0})  # Differs only past the cut.
  with pytest.raises(UserError, match="same point twice"):
    check_run_names([{"a": 1}, {"a": 1}])


def test_load_sweep_from_file(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(CONFIG_PY + SWEEP_PY)
  points = load_sweep(f"{path}:tiny")
  assert len(points) == 5 and points[-1] == {"algo.name": "grpo", "trainer.mesh": (2, 4)}
  (tmp_path / "nosweep.py").write_text(CONFIG_PY)
  with pytest.raises(UserError, match="defines no get_sweep"):
    load_sweep(str(tmp_path / "nosweep.py"))
  with pytest.raises(MissingFileError, match="does not exist") as e:
    load_sweep(str(tmp_path / "missing.py"))
  assert isinstance(
      e.value, FileNotFoundError
  )  # Still caught by callers that expect the built-in type.
