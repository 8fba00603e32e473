"""Built-in tools: a calculator and a Python sandbox.

A tool is a function `tool(args: str, timeout_s: float) -> str` that returns
its result as text, or raises `ToolError` with a short lowercase reason
(the observation then says `error <reason>`). Both run inside a tool
worker process (streamrl/envs/runner.py), whose deadline kills a tool that
overruns it.

- `calculator`: integer and decimal arithmetic (`+ - * / // % **` and
  parentheses) parsed with `ast`, nothing else evaluated; powers and results
  are bounded so `9**9**9` is an error, not a hang. The `calc` tool does one
  operation per call (`step_calculator`): the leftmost innermost one, and
  answers with what is left, `4821+3377+1234` -> `8198+1234`, so a longer
  expression takes more calls (the turns of the built-in agentic task).
- `python_sandbox`: runs the code in a fresh `python -I` subprocess with
  CPU-time, memory, file-size and process limits, its own empty temporary
  directory as working directory, an empty environment, no stdin, and no
  network where the OS allows a new network namespace (Linux user
  namespaces); it dies with its worker. Its output is stdout (then stderr),
  cut to `MAX_OUTPUT_CHARS`.
"""

from __future__ import annotations

import ast
import ctypes
import operator
import os
import resource
import signal
import subprocess
import sys
import tempfile

MAX_OUTPUT_CHARS = 200
MAX_RESULT_DIGITS = 64
MAX_EXPONENT = 256
SANDBOX_MEMORY_BYTES = 512 << 20
SANDBOX_FILE_BYTES = 1 << 20


class ToolError(Exception):
  """A tool call that gave no result; the message is the observation's reason."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(x):
  if isinstance(x, int) and abs(x) >= 10**MAX_RESULT_DIGITS:
    raise ToolError("result too large")
  if isinstance(x, float) and not abs(x) < 1e64:
    raise ToolError("result too large")
  return x


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > 10**6):
      raise ToolError("power too large")
    try:
      return _bounded(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise ToolError("division by zero") from None
    except OverflowError:
      raise ToolError("result too large") from None
  raise ToolError("not arithmetic")


def format_number(x) -> str:
  """An integer as digits; a float as an integer when it is one, else to 6 decimals."""
  if isinstance(x, float):
    if x.is_integer():
      return str(int(x))
    return f"{x:.6f}".rstrip("0")
  return str(x)


def calculator(args: str, timeout_s: float = 1.0) -> str:
  """The value of an arithmetic expression (`4821+3377` -> `8198`)."""
  del timeout_s  # bounded by construction
  return format_number(_eval(_parse(args)))


def _parse(args: str) -> ast.Expression:
  text = args.strip()
  if not text or len(text) > 200:
    raise ToolError("empty expression" if not text else "expression too long")
  try:
    return ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError):
    raise ToolError("bad expression") from None


def _is_number(node) -> bool:
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    node = node.operand
  return isinstance(node, ast.Constant) and type(node.value) in (int, float)


class _FirstStep(ast.NodeTransformer):
  """Replaces the first operation (post-order) whose operands are numbers by its value."""

  done = False

  def _fold(self, node, operands):
    self.generic_visit(node)
    if self.done or _is_number(node) or not all(_is_number(x) for x in operands()):
      return node
    self.done = True
    return ast.Constant(_eval(node))

  def visit_BinOp(self, node):
    return self._fold(node, lambda: (node.left, node.right))

  def visit_UnaryOp(self, node):
    return self._fold(node, lambda: (node.operand,))


def step_calculator(args: str, timeout_s: float = 1.0) -> str:
  """One operation of an arithmetic expression, and what is left
  (`4821+3377+1234` -> `8198+1234`, `8198+1234` -> `9432`)."""
  tree = _parse(args)
  _eval(tree)  # the whole expression must be arithmetic, and bounded
  _FirstStep().visit(tree)
  if isinstance(tree.body, ast.Constant):
    return format_number(tree.body.value)
  return ast.unparse(_Formatted().visit(tree)).replace(" ", "")


class _Formatted(ast.NodeTransformer):
  # Numbers as `format_number` writes them (`2.0` -> `2`), so the rest reads as the results do.
  def visit_Constant(self, node):
    value = node.value
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
      return ast.copy_location(ast.Constant(int(value)), node)
    return node


# ------------------------------------------------------------ the sandbox
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_PR_SET_PDEATHSIG = 1


def _sandbox_preexec(cpu_s: int) -> None:
  """In the child before exec: dies with its parent, no network, bounded resources."""
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  os.setsid()
  # A network namespace of its own (only loopback, down) where the kernel allows one.
  if libc.unshare(_CLONE_NEWNET) != 0:
    libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
  resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
  resource.setrlimit(resource.RLIMIT_AS, (SANDBOX_MEMORY_BYTES, SANDBOX_MEMORY_BYTES))
  resource.setrlimit(resource.RLIMIT_FSIZE, (SANDBOX_FILE_BYTES, SANDBOX_FILE_BYTES))
  resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def python_sandbox(code: str, timeout_s: float = 5.0) -> str:
  """What `code` prints, run in a limited subprocess (see the module docstring)."""
  budget = max(0.1, float(timeout_s) * 0.9)  # leaves the worker time to answer
  with tempfile.TemporaryDirectory(prefix="streamrl-sandbox-") as work:
    try:
      proc = subprocess.run(
          [sys.executable, "-I", "-S", "-c", code],
          cwd=work,
          env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work},
          stdin=subprocess.DEVNULL,
          capture_output=True,
          timeout=budget,
          preexec_fn=lambda: _sandbox_preexec(max(1, int(budget) + 1)),
      )
    except subprocess.TimeoutExpired:
      raise ToolError("timeout") from None
  out = proc.stdout.decode("utf-8", "replace").strip()
  if proc.returncode != 0:
    if proc.returncode < 0:
      raise ToolError(f"killed by signal {-proc.returncode}")
    err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    raise ToolError((err[-1] if err else f"exit status {proc.returncode}")[:MAX_OUTPUT_CHARS])
  return out[:MAX_OUTPUT_CHARS]


TOOLS = {"calc": step_calculator, "py": python_sandbox}
