"""Errors caused by the user's input (a config value, a path, a cluster address).

A `UserError` carries one sentence that names the fix. The launch scripts
print just that sentence and exit non-zero (no traceback; `--debug` or
STREAMRL_DEBUG=1 shows it). Anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
  """Bad input from the user: the message is one sentence naming the fix."""
