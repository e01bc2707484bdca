"""Child process for the storage tests: writes or verifies key-derived pages in a store.

usage: storage_child.py MODE BACKEND PATH [ARGS...]   (prints one JSON line of results last)

  write  START COUNT   write pages [START, START+COUNT) of the shared key list, flush
  verify START COUNT   read them back; exit 3 on any wrong byte
  loop   PAGES         write batches of PAGES new pages forever: "S i" before, "C i" after each flush
  readonly COUNT       strict=False: pages [0, COUNT) must hit; writing more must fail quietly
  open                 open the store with the default (strict) settings: the error it raised, or none
  fsize  LIMIT COUNT   RLIMIT_FSIZE=LIMIT bytes (disk full for files past LIMIT), then write COUNT pages
"""

from __future__ import annotations

import json
import signal
import sys

import numpy as np

from storage_helpers import GEOM, HostKVPool, check_keyed_pages, keys_for, make_store, put_keyed_pages

N_KEYS = 512
BATCH = 16


def open_store(backend: str, path: str, **cfg):
    pool = HostKVPool(GEOM, BATCH, "page_first")
    return make_store(backend, path, {"target": pool}, refresh_interval_s=0.0, **cfg)


def write(store, keys) -> list[bool]:
    ok = []
    for i in range(0, len(keys), BATCH):
        chunk = keys[i : i + BATCH]
        ids = np.arange(len(chunk))
        put_keyed_pages(store, "target", chunk, ids)
        ok += store.batch_set(chunk, ids)
    return ok


def verify(store, keys) -> tuple[int, int]:
    """(pages that hit, wrong pages)."""
    hits = wrong = 0
    for i in range(0, len(keys), BATCH):
        chunk = keys[i : i + BATCH]
        ids = np.arange(len(chunk))
        flags = store.batch_get(chunk, ids)
        for j, (k, f) in enumerate(zip(chunk, flags)):
            if f:
                hits += 1
                try:
                    check_keyed_pages(store, "target", [k], [j])
                except AssertionError:
                    wrong += 1
    return hits, wrong


def main(argv: list[str]) -> int:
    mode, backend, path = argv[:3]
    rest = [int(a) for a in argv[3:]]
    all_keys = keys_for(N_KEYS, seed=0)
    if mode == "write":
        start, count = rest
        store = open_store(backend, path)
        ok = write(store, all_keys[start : start + count])
        flushed = store.flush(60)
        store.close()
        print(json.dumps({"accepted": sum(ok), "flushed": flushed, **store.metrics.snapshot()}))
        return 0
    if mode == "verify":
        start, count = rest
        store = open_store(backend, path)
        keys = all_keys[start : start + count]
        hits, wrong = verify(store, keys)
        res = {"hits": hits, "wrong": wrong, "exists": store.batch_exists(keys), **store.metrics.snapshot()}
        res["hits"] = hits
        store.close()
        print(json.dumps(res))
        return 3 if wrong else 0
    if mode == "loop":
        (pages,) = rest
        store = open_store(backend, path, segment_pages=pages, max_pending_pages=4 * pages)
        i = 0
        while True:
            write(store, keys_for(pages, seed=1000 + i))
            print(f"S {i}", flush=True)
            store.flush(120)
            print(f"C {i}", flush=True)
            i += 1
    if mode == "open":
        try:
            open_store(backend, path).close()
        except Exception as e:
            print(
                json.dumps({"error": type(e).__name__, "is_value_error": isinstance(e, ValueError), "message": str(e)})
            )
            return 0
        print(json.dumps({"error": None}))
        return 0
    if mode == "readonly":
        (count,) = rest
        store = open_store(backend, path, strict=False)
        hits, wrong = verify(store, all_keys[:count])
        new = keys_for(8, seed=777)
        ok = write(store, new)
        store.flush(30)
        res = {
            "hits": hits,
            "wrong": wrong,
            "new_exists": store.batch_exists(new),
            "accepted": sum(ok),
            **store.metrics.snapshot(),
        }
        store.close()
        print(json.dumps(res))
        return 3 if wrong else 0
    if mode == "fsize":
        import resource

        limit, count = rest
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of dying
        store = open_store(backend, path, segment_pages=count, max_pending_pages=max(count, 8))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        keys = keys_for(count, seed=4242)
        ok = write(store, keys)
        store.flush(60)
        exists = store.batch_exists(keys)
        hits, wrong = verify(store, keys)
        store.close()
        print(
            json.dumps(
                {"accepted": sum(ok), "exists": exists, "hits": hits, "wrong": wrong, **store.metrics.snapshot()}
            )
        )
        return 3 if wrong else 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
