"""Storage tests: backend fixtures, and clean skipping where orbax is missing.

``memory`` and ``file`` need numpy only and run everywhere (including the Python 3.11 torch
env, where CRCs fall back to zlib's CRC-32 if google-crc32c is absent). Tests of the orbax
segment log live in ``orbax/`` (mirroring ``hicache_jax/storage/orbax/``) and are not
collected without orbax-checkpoint, tensorstore and google-crc32c (the ``jax`` extra, Python
3.12). This directory is on ``sys.path`` for them too (``storage_helpers``, ``test_faults``).
"""

import pytest

from storage_helpers import BACKENDS, HAVE_ORBAX

collect_ignore = [] if HAVE_ORBAX else ["orbax"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
