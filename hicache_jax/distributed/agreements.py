"""Agreements over ``jax.distributed``: the coordination service's key-value store, and device
collectives.

Both reduce a fixed-shape int64 vector with MIN over the processes that called
``jax.distributed.initialize`` (``hicache_jax.cache.agreement``). JAX is imported lazily: this
module imports with numpy alone.

``KVStoreAgreement`` (the coordination service, a CPU-side gRPC channel)
    Call ``c``: set ``{name}/{block}/{c}/{rank}`` (``block = c // 64``) to the vector's bytes,
    wait at barrier ``{name}/b/{c}`` (bounded by ``timeout_s``: a rank that never arrives
    raises ``AgreementError`` on the others instead of hanging them), read the directory
    ``{name}/{block}/{c}/`` and take the MIN: three round trips. Passing barrier ``c`` means
    every rank finished call ``c - 1``, so at the first call of a block rank 0 deletes the
    previous block's directory (one more round trip per 64 calls): the store holds at most
    two blocks of keys. Barriers with different ids are independent, so instances with
    different ``name``s may run on different threads at once (the coordination service
    allows that from any thread); one instance belongs to one thread, and every rank's
    instance of a name must be called the same number of times.

``DeviceAgreement`` (device collectives)
    ``multihost_utils.process_allgather`` of the vector (its int64 bits carried as twice as
    many int32s, so no 64-bit mode is needed), then the MIN in numpy. It is a jitted device
    computation over all processes: call it from the thread that dispatches device work,
    in the same order on every rank (it queues behind device work in flight). A device
    collective has no timeout of its own, so by default each call first waits at a
    coordination-service barrier bounded by ``arrival_timeout_s`` (every rank has arrived,
    so the collective cannot hang); ``arrival_timeout_s=None`` skips it (faster, unbounded).

The cost of one call per implementation is measured by ``benchmarks/bench_agreement.py``.
"""

from __future__ import annotations

import numpy as np

from ..cache.agreement import Agreement, AgreementError, check_rank, check_values

_BLOCK = 64  # KVStoreAgreement: calls per key directory (deleted as a whole)


def _global_state():
    from jax._src.distributed import global_state  # the client orbax and multihost_utils use too

    if global_state.client is None:
        raise AgreementError("jax.distributed is not initialized (call jax.distributed.initialize first)")
    return global_state


def _check_timeout(timeout_s: object, name: str) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 86400:
        raise ValueError(f"{name}: expected seconds in (0, 86400), got {timeout_s!r}")
    return float(timeout_s)


class KVStoreAgreement(Agreement):
    """MIN over ranks through the coordination service's key-value store and a bounded barrier."""

    collective = True

    def __init__(
        self,
        name: str = "hicache",
        timeout_s: float = 60.0,
        *,
        client=None,
        rank: int | None = None,
        num_processes: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name: expected a non-empty str without '/', got {name!r}")
        self.timeout_s = _check_timeout(timeout_s, "timeout_s")
        if client is None:
            state = _global_state()
            client = state.client
            rank = state.process_id if rank is None else rank
            num_processes = state.num_processes if num_processes is None else num_processes
        if rank is None or num_processes is None:
            raise ValueError("rank, num_processes: required with an explicit client")
        rank, num_processes = check_rank(rank, num_processes)
        self.client, self.rank, self.num_processes, self.name = client, rank, num_processes, name
        self.calls = 0

    def agree_min(self, values: np.ndarray) -> np.ndarray:
        vec = np.ascontiguousarray(check_values(values), dtype="<i8")
        c = self.calls
        self.calls += 1
        cl, name = self.client, self.name
        block = c // _BLOCK
        cl.key_value_set_bytes(f"{name}/{block}/{c}/{self.rank}", vec.tobytes())
        try:
            cl.wait_at_barrier(f"{name}/b/{c}", int(self.timeout_s * 1000))
        except Exception as e:  # the runtime raises its own error types (XlaRuntimeError)
            raise AgreementError(
                f"rank {self.rank}: agreement {name!r} call {c}: the barrier did not complete "
                f"within {self.timeout_s:g} s ({e})"
            ) from e
        entries = cl.key_value_dir_get_bytes(f"{name}/{block}/{c}/")
        if len(entries) != self.num_processes:
            raise AgreementError(
                f"agreement {name!r} call {c}: {len(entries)} ranks' values, expected {self.num_processes}"
            )
        rows = [np.frombuffer(b, dtype="<i8") for _, b in entries]
        if any(r.shape != vec.shape for r in rows):
            raise AgreementError(f"agreement {name!r} call {c}: ranks sent shapes {sorted({r.shape for r in rows})}")
        if block and c % _BLOCK == 0 and self.rank == 0:
            cl.key_value_delete(f"{name}/{block - 1}")  # every rank is past call c - 1: the whole block
        return np.minimum.reduce(rows).astype(np.int64)

    def close(self) -> None:
        """Delete this instance's keys (rank 0; call after the last agreement of every rank)."""
        if self.calls and self.rank == 0:
            try:
                self.client.key_value_delete(self.name)
            except Exception:  # noqa: BLE001 - the service may be gone at shutdown
                pass

    def __repr__(self) -> str:
        return f"KVStoreAgreement(name={self.name!r}, rank={self.rank}, num_processes={self.num_processes})"


class DeviceAgreement(Agreement):
    """MIN over ranks through ``multihost_utils.process_allgather`` (a device collective)."""

    collective = True

    def __init__(self, name: str = "hicache-device", arrival_timeout_s: float | None = 60.0) -> None:
        state = _global_state()
        self.rank, self.num_processes = state.process_id, state.num_processes
        self.name = name
        self.arrival = None if arrival_timeout_s is None else _check_timeout(arrival_timeout_s, "arrival_timeout_s")
        self.client = state.client
        self.calls = 0

    def agree_min(self, values: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        vec = np.ascontiguousarray(check_values(values), dtype="<i8")
        c = self.calls
        self.calls += 1
        if self.arrival is not None:
            try:
                self.client.wait_at_barrier(f"{self.name}/arrive/{c}", int(self.arrival * 1000))
            except Exception as e:  # noqa: BLE001
                raise AgreementError(
                    f"rank {self.rank}: agreement {self.name!r} call {c}: not every rank arrived "
                    f"within {self.arrival:g} s ({e})"
                ) from e
        rows = np.asarray(multihost_utils.process_allgather(vec.view("<i4")))
        return rows.reshape(self.num_processes, -1).view("<i8").min(axis=0).astype(np.int64)

    def __repr__(self) -> str:
        return f"DeviceAgreement(rank={self.rank}, num_processes={self.num_processes})"


AGREEMENTS = ("kv", "device")


def make_agreement(kind: str, **kwargs) -> Agreement:
    """``"kv"``: ``KVStoreAgreement``; ``"device"``: ``DeviceAgreement`` (after
    ``jax.distributed.initialize``)."""
    if kind == "kv":
        return KVStoreAgreement(**kwargs)
    if kind == "device":
        return DeviceAgreement(**kwargs)
    raise ValueError(f"kind: expected one of {list(AGREEMENTS)}, got {kind!r}")
