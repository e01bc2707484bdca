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
(L1 + host hits), then attaches a fresh adapter (empty host tier) over an emptied L1 on the
same L3 directory (storage hits). The tiny model, tokenizer and CPU shims come from the test
fixture (``tests/integrations/esurge_fixture.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
import esurge_fixture as F  # noqa: E402 - the CPU shims must run before easydel is imported

from hicache_jax.cache import HiCacheConfig  # noqa: E402
from hicache_jax.integrations.easydel import attach  # noqa: E402
from hicache_jax.storage import StorageConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--async-scheduling", action="store_true", help="eSurge's overlap scheduling")
    p.add_argument("--out", default=None, help="write a JSON summary here")
    args = p.parse_args(argv)
    tok_dir, l3_dir = tempfile.mkdtemp(prefix="esurge-tok-"), tempfile.mkdtemp(prefix="esurge-l3-")
    F.install_import_shims()
    F.build_tokenizer(tok_dir)
    engine = F.start_engine(F.tiny_llama(), tok_dir, num_pages=10, async_scheduling=args.async_scheduling)
    config = HiCacheConfig(page_size=F.PAGE, load_back_threshold=F.PAGE,
                           storage=StorageConfig(backend="file", path=l3_dir, prefetch_threshold_tokens=F.PAGE))
    a, b = F.prompt(1, 100), F.prompt(2, 100)
    log = []

    def serve(handle, name, text):
        tokens = F.greedy(engine, text)
        adm = handle.admissions[-1]
        log.append({"step": name, "tokens": tokens, "device": adm.device, "host": adm.host, "storage": adm.storage,
                    "prefill_scheduled": adm.scheduled})
        print(f"  {name:34s} cached: device {adm.device:3d}, host {adm.host:3d}, storage {adm.storage:3d}; "
              f"eSurge prefilled {adm.scheduled} of {adm.prompt_tokens} tokens")
        return tokens

    try:
        handle = attach(engine, config, model="tiny-llama-demo", weights_revision="r1")
        first = serve(handle, "A (cold)", a)
        serve(handle, "B (evicts A from eSurge's pool)", b)
        again = serve(handle, "A again", a)
        handle.detach()
        assert engine.scheduler.kv_cache_manager.reset_prefix_cache()
        handle = attach(engine, config, model="tiny-llama-demo", weights_revision="r1")
        restart = serve(handle, "A, new adapter, same L3", a)
        handle.detach()
    finally:
        F.close_engine(engine)
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
