"""Pipeline modes: how generation and training are arranged in time.

`colocated` and `sync` run generate-then-train each iteration (see
`sync.py`); `stream` and `async` overlap the two (see `stream.py`).
"""

from __future__ import annotations


def make_pipeline(config, model_dir: str, trainer):
  mode = config.pipeline.mode
  if mode in ("colocated", "sync"):
    from streamrl.pipeline.sync import SyncPipeline  # pylint: disable=g-import-not-at-top
    return SyncPipeline(config, model_dir, trainer)
  from streamrl.pipeline.stream import StreamPipeline  # pylint: disable=g-import-not-at-top
  return StreamPipeline(config, model_dir, trainer)
