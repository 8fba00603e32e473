"""Typed settings: every config key is mapped, defaults live once, bad values fail early."""

import ast
import dataclasses
import glob
import os

import pytest

from streamrl import cli
from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.errors import UserError

pytestmark = [pytest.mark.unit]

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = os.path.join(ROOT, "configs")


def leaves(node, prefix=""):
  out = set()
  for k in node.keys():
    v = node[k]
    if hasattr(v, "keys"):
      out |= leaves(v, f"{prefix}{k}.")
    else:
      out.add(f"{prefix}{k}")
  return out


def rl_configs():
  """Every config of an RL run (ranker and planner configs have their own readers)."""
  out = []
  for path in sorted(glob.glob(os.path.join(CONFIGS, "*.py"))):
    cfg = config_lib.load_config(path)
    if "advantage" in cfg:
      out.append(path)
  return out


def test_the_rl_configs_are_found():
  names = {os.path.basename(p) for p in rl_configs()}
  assert {"ppo.py", "grpo.py", "ppo_qwen2_5_7b.py"} <= names


@pytest.mark.parametrize("path", rl_configs(), ids=os.path.basename)
def test_every_config_leaf_is_a_setting_and_every_setting_is_in_the_config(path):
  cfg = config_lib.load_config(path)
  given, known = leaves(cfg), set(settings.config_keys())
  assert given - known == set(), "config keys no setting reads"
  assert known - given == set(), "settings read from keys the config lacks"
  s = settings.from_config(cfg, check_files=False)
  # The mapping round-trips: what is logged as config.json maps back to s.
  assert settings.from_config(settings.to_config(s), check_files=False) == s


def test_each_key_is_read_by_exactly_one_field():
  keys = settings.config_keys()
  assert len(keys) == len(set(keys))


def test_defaults_are_the_dataclass_defaults():
  s = settings.from_config(settings.default_config())
  assert s == settings.Settings()


def test_an_unknown_key_is_refused_with_its_name():
  cfg = settings.default_config()
  cfg.trainer.lrr = 1.0
  with pytest.raises(UserError, match="trainer.lrr"):
    settings.from_config(cfg)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("optimizer.lr", -1.0, "optimizer.lr"),
        ("engine.num_instances", 0, "num_instances"),
        ("sampling.temperature", -0.5, "temperature"),
        ("sampling.top_p", 0.0, "top_p"),
        ("sampling.max_tokens", 200, "max_model_len"),
        ("trainer.micro_batch_size", 5, "micro_batch_size"),
        ("loss.agg", "mean", "loss.agg"),
        ("loss.rollout_correction", "yes", "rollout_correction"),
        ("advantage.estimator", "grpo", "group_size"),
        ("pipeline.mode", "turbo", "pipeline.mode"),
        ("pipeline.max_staleness", 0, "max_staleness"),
        ("task.reward", "nope", "task.reward"),
        ("model.dtype", "int8", "model.dtype"),
        ("model.path", "/nonexistent/model", "config.json"),
        ("scheduler.latency_profile", "/nonexistent.json", "latency_profile"),
        ("transfer.enabled", True, "colocated"),
        ("task.trace_token_fraction", 0.0, "trace_token_fraction"),
        ("task.trace_token_fraction", 1.5, "trace_token_fraction"),
        ("engine.gpus_per_instance", -1, "gpus_per_instance"),
        ("engine.tensor_parallel_size", 0, "tensor_parallel_size"),
        ("engine.gpus_per_instance", 2, "tensor_parallel_size=2"),
        ("engine.gpu_memory_utilization", 0.0, "gpu_memory_utilization"),
        ("engine.gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
        ("trainer.compute_dtype", "float16", "trainer.compute_dtype"),
        ("trainer.compute_dtype", "fp8", "trainer.compute_dtype"),
        ("trainer.remat", "yes", "trainer.remat"),
        ("trainer.logprob_chunk", -1, "trainer.logprob_chunk"),
    ],
)
def test_bad_values_fail_with_one_sentence_naming_the_key(key, value, match):
  cfg = settings.default_config()
  group, leaf = key.split(".")
  if key == "scheduler.latency_profile":
    cfg.scheduler.kind = "oracle"
  if key.startswith("task.trace_"):
    cfg.task.kind = "trace"
  cfg[group][leaf] = value
  with pytest.raises(UserError, match=match) as info:
    settings.from_config(cfg)
  assert "\n" not in str(info.value)


def test_a_wrong_type_in_a_plain_dict_config_is_refused():
  cfg = settings.default_config().to_dict()
  cfg["optimizer"]["lr"] = "fast"
  with pytest.raises(UserError, match="optimizer.lr='fast' must be float"):
    settings.from_config(cfg)


def test_a_missing_ranker_checkpoint_is_refused_before_anything_starts(tmp_path):
  cfg = settings.default_config()
  cfg.scheduler.kind = "skew"
  cfg.scheduler.ranker_checkpoint = str(tmp_path)
  with pytest.raises(UserError, match="ranker_checkpoint"):
    settings.from_config(cfg)


def test_rollout_correction_auto_follows_the_mode():
  loss = settings.Loss()
  assert loss.resolved("sync").rollout_correction == "none"
  assert loss.resolved("stream").rollout_correction == "none"
  assert loss.resolved("async").rollout_correction == "tis"
  mis = dataclasses.replace(loss, rollout_correction="mis")
  assert mis.resolved("async") is mis


def test_partial_auto_resumes_responses_in_async_only():
  def with_(mode, partial):
    s = settings.Settings()
    return s.replace(pipeline=dataclasses.replace(s.pipeline, mode=mode, partial=partial))

  assert with_("async", "auto").partial_rollouts and with_("async", "on").partial_rollouts
  assert not with_("async", "off").partial_rollouts
  for mode in ("colocated", "sync", "stream"):
    s = with_(mode, "auto")
    settings.validate(s, check_files=False)  # auto is fine in every mode
    assert not s.partial_rollouts
    with pytest.raises(ValueError, match="pipeline.partial=off"):
      settings.validate(with_(mode, "on"), check_files=False)
  bad = with_("async", "auto")
  bad = bad.replace(pipeline=dataclasses.replace(bad.pipeline, partial_oversample=0.0))
  with pytest.raises(ValueError, match="partial_oversample"):
    settings.validate(bad, check_files=False)


_GROUPS = set(settings.PARTS) | {"generation", "algo"}  # and the groups renamed in 0.1


def test_lower_modules_never_read_the_config_dict():
  # Only settings.py maps the ConfigDict; every other module gets its own
  # settings dataclass. (The ranker and the transfer service keep configs of
  # their own, with other keys, and so do the planner and the simulator.)
  offenders = []
  for path in glob.glob(os.path.join(ROOT, "streamrl", "**", "*.py"), recursive=True):
    if os.path.basename(path) == "settings.py" or any(
        f"/{pkg}/" in path for pkg in ("ranker", "transfer", "planner", "sim")
    ):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if (
          isinstance(node, ast.Attribute)
          and node.attr in _GROUPS
          and isinstance(node.value, ast.Name)
          and node.value.id in ("config", "cfg", "c")
      ):
        offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
  assert offenders == []


def _type_only(tree):
  """Nodes under `if typing.TYPE_CHECKING:` (annotations; nothing at run time)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
  return out


def _imports(path, modules, *, runtime_only=False):
  """streamrl modules `path` imports, at module level or inside functions
  (`runtime_only`: leaving out imports for type annotations only)."""
  tree = ast.parse(open(path).read())
  skip = _type_only(tree) if runtime_only else set()
  out = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from pkg import mod` depends on the module; `from mod import name` on mod.
      subs = [f"{node.module}.{a.name}" for a in node.names]
      names = [n for n in subs if n in modules] or [node.module]
    else:
      continue
    out |= {n for n in names if n in modules}
  return out


def _streamrl_modules():
  """{dotted module name: path} of every module under streamrl/ (packages by their name)."""
  modules = {}
  for path in glob.glob(os.path.join(ROOT, "streamrl", "**", "*.py"), recursive=True):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    modules[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return modules


def test_no_import_cycles_in_streamrl_counting_function_level_imports():
  modules = _streamrl_modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  # A package's __init__ importing its own submodules is not a cycle with them
  # when they import siblings: count edges between real modules only.
  cycles, state = [], {}

  def visit(m, stack):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        cycles.append(stack[stack.index(n) :] + [n])
      elif n not in state:
        visit(n, stack)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [])
  assert cycles == []


# ------------------------------------------------- the key is the attribute
def _read(s, key):
  """The Settings attribute at dotted path `key`."""
  out = s
  for name in key.split("."):
    out = getattr(out, name)
  return out


def _assert_keys_are_attributes(config, points=()):
  """Each leaf key of `config` (and of each override point) reads back as
  the attribute of the same dotted path, with the value it was given."""
  s = settings.from_config(config, check_files=False)
  for key in leaves(config):
    want = _lookup(config, key)
    assert _read(s, key) == (tuple(want) if isinstance(want, list) else want), key
  for point in points:
    cfg = config_lib.apply_overrides(config, point)
    s = settings.from_config(cfg, check_files=False)
    for key, value in point.items():
      got = _read(s, key)
      assert got == (tuple(value) if isinstance(value, list) else value), (key, got, value)


def _lookup(config, key):
  node = config
  for name in key.split("."):
    node = node[name]
  return node


@pytest.mark.parametrize("path", rl_configs(), ids=os.path.basename)
def test_every_key_is_its_attribute_path_in_configs_and_their_sweeps(path):
  cfg = config_lib.load_config(path)
  spec = path
  points = []
  module_text = open(path).read()
  if "def get_sweep" in module_text:
    points = config_lib.load_sweep(spec)
    for point in points:
      assert all(k in set(settings.config_keys()) for k in point), point
  _assert_keys_are_attributes(cfg, points)


def test_every_key_of_an_emitted_plan_is_its_attribute_path(tmp_path, monkeypatch):
  from streamrl.planner import emit
  from streamrl.planner.run import run_plan

  monkeypatch.chdir(ROOT)
  plan_cfg = config_lib.load_config(os.path.join(CONFIGS, "plan", "qwen7b_single_dc.py"))
  for target in emit.TARGETS:
    plan = emit.build_plan(run_plan(plan_cfg), target=target, max_instances=2)
    path = str(tmp_path / f"{target}.json")
    emit.write_plan(plan, path)
    overrides = emit.load_plan(path)["overrides"]
    assert set(overrides) <= set(settings.config_keys())
    _assert_keys_are_attributes(config_lib.load_config("configs/ppo.py"), [overrides])


def test_every_part_field_is_a_key_and_no_group_is_read_under_another_name():
  for part, cls in settings.PARTS.items():
    assert isinstance(getattr(settings.Settings(), part), cls)
    for f in dataclasses.fields(cls):
      assert f"{part}.{f.name}" in settings.config_keys()
  assert set(settings.default_config().keys()) == set(settings.PARTS) | {"seed"}


# ------------------------------------------------------ keys renamed in 0.1
def test_old_keys_map_to_their_new_names_and_say_so(capfd):
  from streamrl.config import renames

  renames._noted.clear()
  assert set(renames.OLD_TO_NEW.values()) <= set(settings.config_keys())
  assert not set(renames.OLD_TO_NEW) & set(settings.config_keys())
  base = settings.default_config()
  # Overrides (the command line, sweeps, plans go through apply_overrides).
  cfg = config_lib.apply_overrides(base, ["generation.partial=on", "pipeline.mode=async"])
  cfg = config_lib.apply_overrides(cfg, {"algo.kl_coef": 0.0, "trainer.lr": 1e-4})
  s = settings.from_config(cfg)
  assert (s.pipeline.partial, s.kl.coef, s.optimizer.lr) == ("on", 0.0, 1e-4)
  err = capfd.readouterr().err
  assert "'generation.partial' is now 'pipeline.partial'" in err
  assert "'algo.kl_coef' is now 'kl.coef'" in err and "'trainer.lr' is now 'optimizer.lr'" in err
  # A config.json saved before the rename maps onto the same settings.
  old = {"generation": {"partial": "on", "max_tokens": 40}, "pipeline": {"mode": "async"}}
  s = settings.from_config(old)
  assert (s.pipeline.partial, s.sampling.max_tokens) == ("on", 40)
  # Both names at once is refused with the name to keep.
  with pytest.raises(UserError, match="keep only 'pipeline.partial'"):
    settings.from_config({"generation": {"partial": "on"}, "pipeline": {"partial": "off"}})
  # Each old key's note comes once per process.
  renames._noted.clear()
  config_lib.apply_overrides(base, ["generation.top_p=0.9"])
  config_lib.apply_overrides(base, ["generation.top_p=0.8"])
  assert capfd.readouterr().err.count("'generation.top_p' is now") == 1


def test_old_keys_on_the_command_line_are_renamed_for_run_configs_only():
  from absl import flags

  fv = flags.FlagValues()
  cli.define_config_file("config", None, "c", flag_values=fv)
  argv = [
      "main.py",
      "--config=configs/ppo.py",
      "--config.generation.partial=off",
      "--config.trainer.lr=1e-4",
      "--config.trainer.num_iterations=3",
  ]
  new = cli._rename_flag_keys(argv, fv)
  assert new[2:] == [
      "--config.pipeline.partial=off",
      "--config.optimizer.lr=1e-4",
      "--config.trainer.num_iterations=3",
  ]
  # A config of another schema that has the old key keeps it.
  other = ["train_ranker.py", "--config=configs/ranker.py:tiny", "--config.steps=3"]
  assert cli._rename_flag_keys(other, fv) == other


def test_fingerprints_leave_out_defaults_so_new_fields_never_block_a_resume():
  from streamrl.trainer import setup

  s = settings.Settings()
  assert setup.fingerprint(s) == {}
  changed = s.replace(kl=dataclasses.replace(s.kl, coef=0.0))
  assert setup.fingerprint(changed) == {"kl": {"coef": 0.0}}


def test_a_workdir_with_a_full_pre_rename_fingerprint_still_resumes(tmp_path):
  import numpy as np

  from streamrl.trainer import setup
  from streamrl.trainer.checkpoint import Checkpointer

  s = settings.from_config(config_lib.load_config(os.path.join(CONFIGS, "grpo.py")))
  old = Checkpointer(str(tmp_path / "checkpoints"), keep=1, fingerprint=setup.full_fingerprint(s))
  old.save(1, {"w": np.zeros(2, np.float32)}, {"it": 1})
  old.close()
  ckpt = setup.open_checkpoints(s, str(tmp_path))  # no UserError: the same run
  assert ckpt.restore({"w": np.zeros(2, np.float32)})[0] == 1
  ckpt.close()
  other = s.replace(kl=dataclasses.replace(s.kl, coef=s.kl.coef + 0.5))
  with pytest.raises(UserError, match="kl.coef"):
    setup.open_checkpoints(other, str(tmp_path))


# The layers of streamrl/, lowest first: a module may import its own layer
# and those below, never one above (function-level imports included). Each
# part's config module (`streamrl/<part>/config.py`: plain frozen dataclasses)
# may be read from any layer.
LAYERS = (
    {"errors", "config", "cli", "metrics", "lifecycle", "usercode", "oom", "allocator"},
    {"cluster", "data", "envs", "rl", "transfer", "elastic", "models", "ranker"},
    {"trainer", "scheduling"},
    {"generator"},
    {"pipeline", "sim"},
    {"planner"},
    {"train"},
    {"experiment", "workload"},
)


def _layer(module):
  name = module.split(".")[1] if "." in module else module
  return next(i for i, names in enumerate(LAYERS) if name in names)


def test_no_module_imports_a_layer_above_its_own():
  modules = _streamrl_modules()
  modules.pop("streamrl")
  upward = [
      f"{m} -> {n}"
      for m, p in sorted(modules.items())
      for n in sorted(_imports(p, modules, runtime_only=True))
      if n != "streamrl" and _layer(n) > _layer(m) and not n.endswith(".config")
  ]
  assert upward == []


# Dataclasses outside the run's parts that share field names with one part.
# Each is its own concept (why, below); a field they share with the part must
# have the part's default, or be listed in _TRANSLATED. A new class that
# repeats a part's fields fails here until it is deleted or listed.
_MIRRORS = {
    ("streamrl.models.config", "ComputeConfig"): (
        "trainer",
        "the models' forward-pass options; Trainer.compute builds it (auto dtype resolved)",
    ),
    ("streamrl.data.tasks", "TaskConfig"): (
        "task",
        "the synthetic task distribution, with shape fields the run does not set",
    ),
    ("streamrl.sim.config", "SimConfig"): ("pipeline", "a simulated run, not a live one"),
    ("streamrl.planner.allocation", "Workload"): (
        "scheduler",
        "a planned workload's work pool and migration (a plan config's keys), not a live run's",
    ),
    ("streamrl.cluster.start", "ClusterInfo"): (
        "cluster",
        "the cluster found at start; no defaults",
    ),
    ("streamrl.trainer.memory_plan", "Trainee"): (
        "mesh",
        "the mesh sizes of one run's memory plan, -1 resolved to a device count",
    ),
}
# (class name, field): why its default differs
_TRANSLATED: dict = {
    ("Trainee", "fsdp"): "the plan's mesh is resolved: mesh.fsdp=-1 becomes the device count",
    ("ComputeConfig", "remat"): "a forward pass runs one policy; trainer.remat='auto' is "
    "resolved by the memory plan before the trainer is built",
    ("SimConfig", "partial_oversample"): "0 turns the simulator's partial rollouts off (the run's "
    "pipeline.partial does that there)",
}


def _dataclass_fields_by_class():
  """{(module, class): field names} of every dataclass defined under streamrl/."""
  out = {}
  for mod, path in _streamrl_modules().items():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.ClassDef) and any(
          "dataclass" in ast.unparse(d) for d in node.decorator_list
      ):
        out[(mod, node.name)] = {
            s.target.id
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
  return out


def test_no_default_is_defined_twice():
  import importlib  # pylint: disable=g-import-not-at-top

  parts = {p: {f.name: f for f in dataclasses.fields(c)} for p, c in settings.PARTS.items()}
  part_classes = {(c.__module__, c.__name__) for c in settings.PARTS.values()}
  found = {}
  for key, names in _dataclass_fields_by_class().items():
    if key in part_classes:
      continue
    for part, fields in parts.items():
      if len(names & set(fields)) >= 2:
        found[key] = part
  assert found == {k: part for k, (part, _) in _MIRRORS.items()}
  for (mod, name), part in found.items():
    cls = getattr(importlib.import_module(mod), name)
    part_defaults = settings.PARTS[part]()
    for f in dataclasses.fields(cls):
      if f.name not in parts[part] or (name, f.name) in _TRANSLATED:
        continue
      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        continue
      default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
      assert default == getattr(part_defaults, f.name), f"{name}.{f.name} vs {part}.{f.name}"


def test_components_take_the_run_parts_themselves():
  # What the duplicates were: none of these names exists any more.
  from streamrl.generator import rollout  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import experience, rl_trainer, step  # pylint: disable=g-import-not-at-top
  from streamrl.transfer import publisher  # pylint: disable=g-import-not-at-top

  gone = {
      rollout: ("SamplingConfig",),
      step: ("LossConfig", "OptimConfig"),
      experience: ("AdvantageConfig",),
      publisher: ("TransferConfig",),
      rl_trainer: ("loss_config", "advantage_config", "optim_configs", "compute_config"),
  }
  assert [f"{m.__name__}.{n}" for m, names in gone.items() for n in names if hasattr(m, n)] == []


def test_settings_functions_are_short():
  # validate is each part's check() plus a list of small cross-part rules.
  paths = [os.path.join(ROOT, "streamrl", "config", "settings.py")]
  paths += glob.glob(os.path.join(ROOT, "streamrl", "**", "config.py"), recursive=True)
  long = []
  for path in paths:
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60:
        long.append(f"{os.path.relpath(path, ROOT)}:{node.name}")
  assert long == []
