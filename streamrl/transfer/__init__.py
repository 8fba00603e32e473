"""Checkpoint-transfer service: versioned, verified weight delivery from the trainer to the generators.

Modules: manifest (payload format, chunks, checksums, schema), payload (a
version's bytes + verification progress), delta (XOR+zlib chunk deltas),
transports (framing, rate limits, TCP and shared-memory data planes),
topology (broadcast/relay plan), service (Publisher, Receiver).
"""

from streamrl.transfer.manifest import (
    ChecksumError,
    Manifest,
    SchemaMismatch,
    TensorSpec,
    TransferError,
    check_schema,
    schema_of,
)
from streamrl.transfer.service import (
    Publisher,
    Receiver,
    TransferConfig,
    default_config,
    spawn_receiver,
)
from streamrl.transfer.topology import ReceiverInfo, TreeNode, plan_direct, plan_topology

__all__ = [
    "ChecksumError",
    "Manifest",
    "Publisher",
    "Receiver",
    "ReceiverInfo",
    "SchemaMismatch",
    "TensorSpec",
    "TransferConfig",
    "TransferError",
    "TreeNode",
    "check_schema",
    "default_config",
    "plan_direct",
    "plan_topology",
    "schema_of",
    "spawn_receiver",
]
