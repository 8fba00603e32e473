"""Ray as the distributed engine: start or join a cluster, share and pin CPU cores.

info = cluster.init_ray_for(s.cluster, s.gpus_needed)   # start or join Ray
shares = cluster.plan_cpu_shares(generator_cpus=2, trainer_cpus=2)

config.py     the `cluster.*` settings (`Cluster`) and node labels
start.py      starting or joining Ray, and checking what the cluster offers
shares.py     CPU shares on one machine and pinning threads to them
addresses.py  node addresses, loopback, and whether an address answers
local.py      a multi-node Ray cluster on one machine (tests, demos,
              launch/cluster.py); imported as `streamrl.cluster.local`
"""

from streamrl.cluster.addresses import (
    LOOPBACK,
    check_node_ip_address,
    check_reachable,
    interface_of,
    is_loopback,
    loopback_kept,
    node_address,
)
from streamrl.cluster.config import Cluster, parse_labels
from streamrl.cluster.shares import (
    CpuShares,
    available_cores,
    bound_trainer_threads,
    pin_process_threads,
    plan_cpu_shares,
)
from streamrl.cluster.start import (
    DATACENTER_LABEL,
    DEFAULT_DATACENTER,
    GENERATION_POOL,
    TRAINING_POOL,
    ClusterInfo,
    check_gpus,
    check_placement,
    init_ray,
    init_ray_for,
    token_available,
    use_token_auth,
    where_am_i,
)

__all__ = [
    "DATACENTER_LABEL",
    "DEFAULT_DATACENTER",
    "GENERATION_POOL",
    "LOOPBACK",
    "TRAINING_POOL",
    "Cluster",
    "ClusterInfo",
    "CpuShares",
    "available_cores",
    "bound_trainer_threads",
    "check_gpus",
    "check_node_ip_address",
    "check_placement",
    "check_reachable",
    "init_ray",
    "init_ray_for",
    "interface_of",
    "is_loopback",
    "loopback_kept",
    "node_address",
    "parse_labels",
    "pin_process_threads",
    "plan_cpu_shares",
    "token_available",
    "use_token_auth",
    "where_am_i",
]
