"""Checkpoint-transfer service: versioned, verified weight delivery from the trainer to the generators.

Modules, one job each:
  config     Transfer: the `transfer.*` settings both ends take
  manifest   payload format, chunks, checksums and digests, schema
  payload    a version's bytes on one node and which chunks are verified so far
  shm        this host's /dev/shm files: checked opens, pins, owned buffers and their pool,
             mappings of others' files, weights files
  delta      XOR+zlib chunk deltas
  topology   the broadcast/relay plan (one receiving receiver per host)
  wire       length-prefixed frames, bounded reads, deadlines
  security   the run's secret (HMAC sessions), the publisher's Ed25519 keys, TLS
  planes     the data planes (TCP, shared memory) and emulated link rates
  node       what both ends share: accept, admit, authenticate, serve, announce
  publisher  Publisher: the trainer's end (publish, plan, sign, track acks)
  receiver   Receiver: a generator's end (pull, verify, load, relay)
  process    spawn_receiver: a Receiver in a process of its own

Protocol: announce, then pull. The publisher announces a version down the
plan and writes it chunk by chunk; every receiver pulls from its parent,
verifies each chunk and serves it on at once, loads the version once all of it
and the publisher's signatures check out, and acks (publisher.py, receiver.py).

Security: every node needs the run's shared secret, on loopback too (any
local process can reach 127.0.0.1), and every receiver the publisher's keys
(made per run by the Publisher: its Ed25519 public key and the run's TLS
certificate); a node built without them refuses to start::

  secret = new_secret()
  pub = Publisher(config, secret=secret)
  r = Receiver("gen0", "dc0", load_fn, config=config, secret=secret, run_keys=pub.run_keys)

Every request is then authenticated, and only the publisher can sign an
announce or a version's manifest (with every chunk's BLAKE3 digest, which TCP
receivers check), so a node that holds the secret cannot make another load
anything else; off loopback every connection is TLS (``transfer.tls``).
Until a peer has proven the secret it gets small frames, one handshake
deadline and a bounded share of a node's connections (wire.py, node.py).

Host path (what runs here): the trainer's lazy export is written once into a
/dev/shm file, every host receives it once (same host: nothing; other hosts:
one TCP stream into a staging file), and the engines load that file in
place (``generator.vllm_worker.WorkerExtension``).

GPU plug point (not built: nothing here can run it). vLLM has a pluggable
weight-transfer API (``vllm/distributed/weight_transfer/``: the worker's
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights``
/ ``finish_weight_update``, reached with ``collective_rpc``; engines chosen by
``EngineArgs(weight_transfer_config={"backend": ...})`` and registered with
``WeightTransferEngineFactory.register_engine``), but its built-in backends
(nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress) all need CUDA,
and its base ``update_weights`` calls ``torch.accelerator.synchronize()``,
which raises on a CPU-only torch. A device-to-device path goes behind the
same interface as the host one: a ``planes.DataPlane`` named "nccl"
whose ``offer`` answers when client and server share a NCCL group, whose
``send`` broadcasts each chunk from device memory (DLPack views of the
trainer's jax arrays, already in the generators' dtype) and whose
``open``/``fill`` receive into the engine's own weight-transfer engine (a
small vLLM backend registered under our name, fed by ``update_weights`` with
the manifest's names/shapes/dtypes) and verify each chunk's checksum before it
counts as ready; manifests, versions, topology, acks and retries stay as they
are, and ``Receiver.load_fn`` becomes ``finish_weight_update``.
"""

from streamrl.transfer.config import Transfer
from streamrl.transfer.manifest import (
    ChecksumError,
    Manifest,
    SchemaMismatch,
    TensorSpec,
    TransferError,
    check_schema,
    schema_of,
)
from streamrl.transfer.payload import VersionTensors
from streamrl.transfer.process import spawn_receiver
from streamrl.transfer.publisher import Publisher
from streamrl.transfer.receiver import Receiver
from streamrl.transfer.security import RunKeys, new_secret
from streamrl.transfer.shm import Pin, WeightsFile
from streamrl.transfer.topology import ReceiverInfo, TreeNode, plan_direct, plan_topology
from streamrl.transfer.wire import AuthenticationError

__all__ = [
    "AuthenticationError",
    "ChecksumError",
    "Manifest",
    "Pin",
    "Publisher",
    "Receiver",
    "ReceiverInfo",
    "RunKeys",
    "SchemaMismatch",
    "TensorSpec",
    "Transfer",
    "TransferError",
    "TreeNode",
    "VersionTensors",
    "WeightsFile",
    "check_schema",
    "new_secret",
    "plan_direct",
    "plan_topology",
    "schema_of",
    "spawn_receiver",
]
