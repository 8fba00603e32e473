r"""Writes a run's trained policy as a Hugging Face model directory.

  python launch/export.py --workdir=workdirs/ppo --out=/tmp/ppo-hf [--step=N] [--overwrite]
      [--nomerge_lora]

exports the actor of checkpoint N (default: the newest) of the run in
--workdir, in the run's model.dtype, with the tokenizer of its policy
directory (a LoRA run's: the policy directory with the adapter merged in,
or with --nomerge_lora the adapter alone as a PEFT directory);
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`vllm.LLM(DIR)` load the result (streamrl/trainer/export.py says what it
holds). A non-empty --out is refused unless --overwrite. A mistake (no such
workdir, no checkpoints, an unknown step) prints one `error: ...` line and
exits with status 2; what Orbax logs goes to <workdir>/libraries.log (when
the workdir is writable).
"""

import os
import sys

# Runnable as `python launch/export.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from streamrl import cli, metrics  # pylint: disable=g-import-not-at-top,wrong-import-position

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
_OUT = flags.DEFINE_string("out", None, "The Hugging Face directory to write.", required=True)
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step to export (default: the newest).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --out if it is not empty.")
_MERGE_LORA = flags.DEFINE_bool(
    "merge_lora",
    True,
    "A LoRA run (trainer.lora_rank > 0): write the policy with the adapter merged in; "
    "--nomerge_lora writes the adapter alone as a PEFT directory.",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --name=value.")
  from streamrl.trainer import export  # pylint: disable=g-import-not-at-top

  workdir = _WORKDIR.value
  export.read_settings(workdir)  # A missing workdir fails before a log file is made there.
  # A read-only workdir (someone else's run) still exports; Orbax then logs here.
  metrics.configure_logging(workdir if os.access(workdir, os.W_OK) else None)
  step = export.export_checkpoint(
      workdir,
      _OUT.value,
      step=_STEP.value,
      overwrite=_OVERWRITE.value,
      merge_lora=_MERGE_LORA.value,
  )
  print(f"wrote {os.path.abspath(_OUT.value)}: the policy of {workdir} at step {step}")


if __name__ == "__main__":
  cli.run_main(main)
