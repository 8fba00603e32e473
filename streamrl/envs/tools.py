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
- `python_sandbox`: runs the code with `python -I -S` in a sandbox of its own
  (streamrl/envs/sandbox.py: by default new user, mount, PID, network and IPC
  namespaces, a read-only view of the interpreter, a private tmpfs, CPU,
  memory, file and process limits; `env.sandbox=unsafe` is a plain limited
  subprocess). Nothing it starts outlives the call, and it dies with its
  worker. Its answer is its stdout, cut to `MAX_OUTPUT_CHARS`, or the last
  line of its stderr as the error.
"""

from __future__ import annotations

import ast
import operator

from streamrl.envs import sandbox

MAX_OUTPUT_CHARS = 200
MAX_RESULT_DIGITS = 64
MAX_EXPONENT = 256


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
def python_sandbox(code: str, timeout_s: float = 5.0) -> str:
  """What `code` prints, run in a sandbox (see the module docstring)."""
  budget = max(0.1, float(timeout_s) * 0.9)  # leaves the worker time to answer
  result = sandbox.python(code, timeout_s=budget)
  if result.timed_out:
    raise ToolError("timeout")
  if result.returncode != 0:
    if result.returncode < 0:
      raise ToolError(f"killed by signal {-result.returncode}")
    err = result.stderr.strip().splitlines()
    raise ToolError((err[-1] if err else f"exit status {result.returncode}")[:MAX_OUTPUT_CHARS])
  return result.stdout.strip()[:MAX_OUTPUT_CHARS]


TOOLS = {"calc": step_calculator, "py": python_sandbox}
