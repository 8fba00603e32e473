"""Typed settings: every config key is mapped, defaults live once, bad values fail early."""

import ast
import dataclasses
import glob
import os

import pytest

from streamrl import config_utils, settings
from streamrl.errors import UserError

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
    cfg = config_utils.load_config(path)
    if "advantage" in cfg:
      out.append(path)
  return out


def test_the_rl_configs_are_found():
  names = {os.path.basename(p) for p in rl_configs()}
  assert {"ppo.py", "grpo.py", "ppo_qwen2_5_7b.py"} <= names


@pytest.mark.parametrize("path", rl_configs(), ids=os.path.basename)
def test_every_config_leaf_is_a_setting_and_every_setting_is_in_the_config(path):
  cfg = config_utils.load_config(path)
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
  s = settings.Settings()
  assert s.rollout_correction == "none"
  s = s.replace(pipeline=dataclasses.replace(s.pipeline, mode="async"))
  assert s.rollout_correction == "tis"
  s = s.replace(loss=dataclasses.replace(s.loss, rollout_correction="mis"))
  assert s.rollout_correction == "mis"


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


def _imports(path, modules):
  """streamrl modules `path` imports, at module level or inside functions."""
  tree = ast.parse(open(path).read())
  out = set()
  for node in ast.walk(tree):
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


def test_no_import_cycles_in_streamrl_counting_function_level_imports():
  base = os.path.join(ROOT, "streamrl")
  modules = {}
  for path in glob.glob(os.path.join(base, "**", "*.py"), recursive=True):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    modules[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
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
