"""The orbax backend's in-place reads (``host_io_checks``): a damaged page in a batch, read
in place, is a miss that leaves no stored bytes, its neighbours hit (round trips, staging and
concurrency run for every backend in ``test_host_io``)."""

import itertools

import pytest

import host_io_checks as chk
from storage_helpers import make_store

_n = itertools.count()


def _flip(st, key):
    """Flip a byte of ``key``'s page inside its segment's OCDBT data file (the segment stays
    indexed: only the read finds out)."""
    plan = st.index.locate("target", [key], set())
    assert len(plan) == 1
    _, seg, slot, _ = plan[0]
    path, offset, _ = st.reader._locations(seg, "target")[slot]
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        b = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("layout", chk.LAYOUTS, ids=lambda l: l.value)
def test_corrupt_page_in_a_batch_is_a_miss_and_neighbours_hit(tmp_path, layout):
    # one page per segment: a damaged page quarantines its own segment only
    make = lambda pools: make_store("orbax", tmp_path / f"s{next(_n)}", pools, segment_pages=1)  # noqa: E731
    chk.check_corrupt_page_in_batch(make, _flip, layout=layout)
