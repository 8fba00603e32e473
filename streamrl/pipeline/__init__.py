"""Pipeline modes: how generation and training are arranged in time.

  colocated  engine in the trainer's process; generate, then train (sync.py)
  sync       engines on Ray actors; the trainer waits for the whole batch (sync.py)
  stream     samples trained on as they arrive, weights pushed per iteration (stream.py)
  async      generation of i+1 overlaps training of i (stream.py)
"""

from __future__ import annotations


def make_pipeline(config, model_dir: str, trainer, backend=None, workdir: str | None = None,
                  cluster=None):
  """The configured mode's pipeline. `backend` replaces the generation backend
  (tests); `cluster` is a ClusterInfo when Ray was already started or joined."""
  mode = config.pipeline.mode
  if mode in ("colocated", "sync"):
    from streamrl.pipeline.sync import SyncPipeline  # pylint: disable=g-import-not-at-top
    return SyncPipeline(config, model_dir, trainer, backend, workdir, cluster)
  from streamrl.pipeline import stream  # pylint: disable=g-import-not-at-top
  if mode == "stream":
    return stream.StreamPipeline(config, model_dir, trainer, backend, workdir, cluster)
  return stream.AsyncPipeline(config, model_dir, trainer, backend, workdir, cluster)
