"""KV events, schema version 1: what a router needs to follow one engine's tiers.

Pure Python, immutable values (any thread may read them). An engine's ``KVEventSource``
(``event_source``) emits them; a router (``hicache_jax.routing``) or a test folds them into
``TierContents``.

Schema 1
========

``KVEvent`` (``to_dict()`` is its JSON form, with ``"schema": 1``):

* ``kind``: ``"stored"`` (the pages ``keys`` are now on ``tier``), ``"removed"`` (they left
  it) or ``"cleared"`` (every page of this engine left ``tier``; on ``storage``, whose pages
  outlive the engine: forget what this engine reported there, its source dropped storage
  events it could not queue; ``keys`` empty);
* ``tier``: ``"device"`` (L1), ``"host"`` (L2) or ``"storage"`` (L3);
* ``keys``: the pages' L3 page keys (32-byte SHA-256 chains, ``storage.keys.page_keys``); on
  device and host, one run of one prefix in prefix order; the same key on several engines
  sharing one L3 is the same page of the same prefix under the same model, geometry, TP shard
  and tenant. JSON: lowercase hex. On ``storage``: the pages one change of the store covered,
  in the order the store made it, which need not be one run of one prefix (a backup batch may
  hold several prefixes' pages, an orbax segment leaving the index takes whatever it held, the
  file store reports each page on its own).
* ``parent_key``: device and host: the key of the page before ``keys[0]`` (None: the run
  starts at the tenant's first page); a router can chain ``stored`` runs into prefixes without
  the tokens. Storage: always None, also for pages after a tenant's first: the store reports
  page keys alone (it never sees the tokens or the tree), a key is a one-way hash of its parent
  key and its tokens, so the parent cannot be recovered from it, and the keys need not form one
  chain. A receiver needs no parent there: a storage page counts for a request when the walk
  over the request's own keys reaches it (``TierContents`` records storage pages with parent
  None, never chaining a storage event's keys).
* ``token_count``: tokens the pages hold (``len(keys) * page_size``).
* ``model``: the model identity the keys were built with.
* ``namespace``: the tenant (``radix_key.encode_namespace("", namespace)``: ``""`` for the
  default); None for storage events (the L3 write reports keys only).

``EventBatch``: one engine's events of one step, in the order they took effect
(``engine``, a monotonically increasing ``seq`` per source, ``events``); ``resync=True``
when the batch starts with ``cleared`` of the device and host tiers followed by their whole
contents (the receiver's view is exact again after it): a source's first batch (``seq`` 0,
accepted after any earlier seq: the engine's source restarted) and the batch after the
bounded queue overflowed.

Version policy: fields are only added under a new ``schema`` number; a consumer must refuse
a schema it does not know (``from_dict`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

SCHEMA_VERSION = 1
EVENT_KINDS = ("stored", "removed", "cleared")
EVENT_TIERS = ("device", "host", "storage")


@dataclass(frozen=True)
class KVEvent:
    kind: str
    tier: str
    keys: tuple = ()
    parent_key: bytes | None = None
    token_count: int = 0
    model: str = ""
    namespace: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind: expected one of {EVENT_KINDS}, got {self.kind!r}")
        if self.tier not in EVENT_TIERS:
            raise ValueError(f"tier: expected one of {EVENT_TIERS}, got {self.tier!r}")
        if (
            isinstance(self.keys, (bytes, str))
            or not isinstance(self.keys, (tuple, list))
            or not all(map(isinstance, self.keys, repeat(bytes)))
        ):
            raise TypeError(f"keys: expected a tuple of page keys (bytes), got {type(self.keys).__name__}")
        object.__setattr__(self, "keys", tuple(self.keys))
        if self.kind == "cleared" and self.keys:
            raise ValueError(f"keys: expected none on a 'cleared' event, got {len(self.keys)}")
        if self.parent_key is not None and not isinstance(self.parent_key, bytes):
            raise TypeError(f"parent_key: expected bytes or None, got {type(self.parent_key).__name__}")
        if isinstance(self.token_count, bool) or not isinstance(self.token_count, int) or self.token_count < 0:
            raise ValueError(f"token_count: expected an int >= 0, got {self.token_count!r}")
        if not isinstance(self.model, str):
            raise TypeError(f"model: expected a str, got {type(self.model).__name__}")
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise TypeError(f"namespace: expected a str or None, got {type(self.namespace).__name__}")

    @classmethod
    def unchecked(
        cls,
        kind: str,
        tier: str,
        keys: tuple,
        parent_key: bytes | None,
        token_count: int,
        model: str,
        namespace: str | None,
    ) -> "KVEvent":
        """The event of these fields, taken as they are: for an event source that builds them
        from the tree itself (``event_source``: a tuple of page keys from its own chain, an
        int count), one per stored or removed node, where the constructor's checks would cost
        more than the event. Anything else builds events with the constructor, which checks
        every field."""
        e = object.__new__(cls)
        d = e.__dict__  # frozen: no __setattr__; written once, as the constructor would
        d["kind"] = kind
        d["tier"] = tier
        d["keys"] = keys
        d["parent_key"] = parent_key
        d["token_count"] = token_count
        d["model"] = model
        d["namespace"] = namespace
        return e

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "kind": self.kind,
            "tier": self.tier,
            "keys": [k.hex() for k in self.keys],
            "parent_key": None if self.parent_key is None else self.parent_key.hex(),
            "token_count": self.token_count,
            "model": self.model,
            "namespace": self.namespace,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "KVEvent":
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"d: expected schema {SCHEMA_VERSION}, got {d.get('schema')!r}")
        pk = d["parent_key"]
        return cls(
            d["kind"],
            d["tier"],
            tuple(bytes.fromhex(k) for k in d["keys"]),
            None if pk is None else bytes.fromhex(pk),
            int(d["token_count"]),
            d["model"],
            d["namespace"],
        )


@dataclass(frozen=True)
class EventBatch:
    engine: str
    seq: int
    events: tuple = field(default=())
    resync: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.engine, str):
            raise TypeError(f"engine: expected a str, got {type(self.engine).__name__}")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise ValueError(f"seq: expected an int >= 0, got {self.seq!r}")
        if not isinstance(self.events, (tuple, list)) or not all(map(isinstance, self.events, repeat(KVEvent))):
            raise TypeError(f"events: expected a tuple of KVEvent, got {type(self.events).__name__}")
        object.__setattr__(self, "events", tuple(self.events))
        if not isinstance(self.resync, bool):
            raise TypeError(f"resync: expected a bool, got {type(self.resync).__name__}")

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "engine": self.engine,
            "seq": self.seq,
            "resync": self.resync,
            "events": [e.to_dict() for e in self.events],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "EventBatch":
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"d: expected schema {SCHEMA_VERSION}, got {d.get('schema')!r}")
        return cls(d["engine"], int(d["seq"]), tuple(KVEvent.from_dict(e) for e in d["events"]), bool(d["resync"]))


class TierContents:
    """One engine's pages per tier, rebuilt from its events alone: ``tiers[tier]`` maps a
    page key to its parent key (None at a namespace seed, and for every storage page: see
    ``parent_key``). Owner: whoever applies batches."""

    def __init__(self) -> None:
        self.tiers: dict[str, dict[bytes, bytes | None]] = {t: {} for t in EVENT_TIERS}
        self.last_seq = -1

    def apply(self, batch: EventBatch) -> None:
        if batch.seq <= self.last_seq and not (batch.seq == 0 and batch.resync):  # seq 0: a new source
            raise ValueError(f"batch: seq {batch.seq} is not after {self.last_seq} (replayed or reordered)")
        self.last_seq = batch.seq
        for e in batch.events:
            self.apply_event(e)

    def apply_event(self, e: KVEvent) -> None:
        pages = self.tiers[e.tier]
        if e.kind == "cleared":
            pages.clear()
        elif e.kind == "stored":
            if e.tier == "storage":  # keys in the store's order, not a chain (module docstring)
                for k in e.keys:
                    pages[k] = None
                return
            prev = e.parent_key
            for k in e.keys:
                pages[k] = prev
                prev = k
        else:
            for k in e.keys:
                pages.pop(k, None)

    def keys(self, tier: str) -> set[bytes]:
        return set(self.tiers[tier])
