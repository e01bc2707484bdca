"""hicache_jax behind EasyDeL's eSurge: host (L2) and storage (L3) tiers for a running engine.

    pip install "easydel==0.3.0" pillow && pip install -e ".[easydel,storage,metrics]"   # own venv: jax 0.9.2
    python examples/easydel_engine.py            # CPU demo: a tiny random Llama, no downloads

With your own engine it is three lines::

    from hicache_jax.cache import HiCacheConfig
    from hicache_jax.integrations.easydel import attach
    from hicache_jax.storage import StorageConfig

    engine = eSurge(model=..., processor=..., page_size=16, enable_prefix_caching=True, ...)
    handle = attach(engine, HiCacheConfig(page_size=16, storage=StorageConfig(backend="file", path="/l3")),
                    model="my-model", weights_revision="2026-11-27")
    ...                                   # engine.generate / chat / serve as before
    handle.stats()["cached_tokens"]       # {"device": ..., "host": ..., "storage": ...}
    handle.detach()

What is cached where: eSurge's page pool is L1 (unchanged). Every request's full computed
pages are copied to the host pool when eSurge frees the request (and written through to L3);
a new request whose prefix left eSurge's pool gets those pages loaded back into eSurge's KV
arrays and counted by eSurge as its own prefix hits. Limits: full-attention models, one
data-parallel replica, prefix caching on; requests with prompt logprobs pass through.

The CPU demo serves prompt A, then prompt B (which evicts A from a 9-page pool), then A again
(L1 + host hits), then terminates the engine and starts a new one with a new adapter on the
same L3 directory (storage hits). The tiny random model, the tokenizer built in a temporary
directory and the CPU workarounds come from ``hicache_jax.integrations.easydel.testing``
(compile caches under ``~/.cache/hicache_jax/esurge``: the first run compiles for a minute).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

from hicache_jax.integrations.easydel import testing as demo

demo.prepare_cpu()  # the CPU, compile caches and import shims: before easydel is imported

from hicache_jax.cache import HiCacheConfig  # noqa: E402
from hicache_jax.integrations.easydel import attach  # noqa: E402
from hicache_jax.storage import StorageConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--async-scheduling", action="store_true", help="eSurge's overlap scheduling")
    p.add_argument("--out", default=None, help="write a JSON summary here")
    args = p.parse_args(argv)
    tok_dir, l3_dir = tempfile.mkdtemp(prefix="esurge-tok-"), tempfile.mkdtemp(prefix="esurge-l3-")
    demo.build_tokenizer(tok_dir)
    model = demo.random_llama()
    config = HiCacheConfig(
        page_size=demo.PAGE,
        load_back_threshold=demo.PAGE,
        storage=StorageConfig(backend="file", path=l3_dir, prefetch_threshold_tokens=demo.PAGE),
    )
    a, b = demo.prompt(1, 100), demo.prompt(2, 100)
    log = []

    def serve(engine, handle, name, text):
        tokens = demo.greedy(engine, text)
        adm = handle.admissions[-1]
        log.append(
            {
                "step": name,
                "tokens": tokens,
                "device": adm.device,
                "host": adm.host,
                "storage": adm.storage,
                "prefill_scheduled": adm.scheduled,
            }
        )
        print(
            f"  {name:34s} cached: device {adm.device:3d}, host {adm.host:3d}, storage {adm.storage:3d}; "
            f"eSurge prefilled {adm.scheduled} of {adm.prompt_tokens} tokens"
        )
        return tokens

    def new_engine():
        return demo.start_engine(model, tok_dir, num_pages=10, async_scheduling=args.async_scheduling)

    try:
        engine = new_engine()
        try:
            handle = attach(engine, config, model="tiny-llama-demo", weights_revision="r1")
            first = serve(engine, handle, "A (cold)", a)
            serve(engine, handle, "B (evicts A from eSurge's pool)", b)
            again = serve(engine, handle, "A again", a)
            handle.detach()  # finishes the L3 writes
        finally:
            demo.close_engine(engine)  # the scheduler and its tokenizer / detokenizer workers
        engine = new_engine()
        try:
            handle = attach(engine, config, model="tiny-llama-demo", weights_revision="r1")
            restart = serve(engine, handle, "A, new engine, same L3", a)
            handle.detach()
        finally:
            demo.close_engine(engine)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
        shutil.rmtree(l3_dir, ignore_errors=True)
    same = first == again == restart
    print("same greedy tokens every time: " + ("yes" if same else "NO"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"requests": log, "same_tokens": same}, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
