"""Storage tests: backend fixtures, and clean skipping where orbax is missing.

``memory`` and ``file`` need numpy only and run everywhere (including the Python 3.11 torch
env, where CRCs fall back to zlib's CRC-32 if google-crc32c is absent). Tests of the orbax
segment log live in ``test_orbax_*.py`` and are not collected without orbax-checkpoint,
tensorstore and google-crc32c (the ``jax`` extra, Python 3.12).
"""

import pytest

from storage_helpers import BACKENDS, HAVE_ORBAX

collect_ignore_glob = [] if HAVE_ORBAX else ["test_orbax_*.py"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
