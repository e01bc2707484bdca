"""Several processes, one cache state: agreements over ``jax.distributed`` and a local launcher.

* ``KVStoreAgreement`` / ``DeviceAgreement`` (``agreements``): the cache's ``Agreement`` over
  the coordination service's key-value store (bounded barriers; worker threads may use their
  own instances) or over device collectives (``process_allgather``).
* ``launch_local`` / ``initialize_from_env`` (``launch``): N local processes joined by
  ``jax.distributed`` on the CPU with gloo collectives (tests, ``--num-processes``).

Imports with numpy alone; JAX is imported when an agreement is built or a rank initializes.
"""

from .agreements import AGREEMENTS, DeviceAgreement, KVStoreAgreement, make_agreement
from .launch import RankResult, RanksFailed, free_port, initialize_from_env, launch_local, run_rank

__all__ = [
    "AGREEMENTS",
    "DeviceAgreement",
    "KVStoreAgreement",
    "RankResult",
    "RanksFailed",
    "free_port",
    "initialize_from_env",
    "launch_local",
    "make_agreement",
    "run_rank",
]
