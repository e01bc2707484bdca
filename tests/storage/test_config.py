import pytest

from hicache_jax.storage import StorageConfig


def test_defaults_and_timeout_formula():
    c = StorageConfig(path="/x")
    assert (c.backend, c.integrity, c.prefetch_policy, c.read_concurrency) == ("orbax", "full", "timeout", 16)
    assert c.prefetch_timeout(0) == 1.0
    assert c.prefetch_timeout(4096) == pytest.approx(2.0)
    hiradix = StorageConfig(
        path="/x", prefetch_timeout_base_s=2.0, prefetch_timeout_per_ki_token_s=0.1, prefetch_timeout_max_s=30.0
    )
    assert hiradix.prefetch_timeout(1024) == pytest.approx(2.1)
    assert hiradix.prefetch_timeout(10**7) == 30.0


def test_segment_pages_sized_by_bytes_unless_set():
    auto = StorageConfig(path="/x")
    assert auto.segment_pages is None
    assert auto.segment_pages_for(64 << 10) == 256  # small pages: the upper bound
    assert auto.segment_pages_for(512 << 10) == 128  # 64 MiB of pages
    assert auto.segment_pages_for(2 << 20) == 64
    assert auto.segment_pages_for(16 << 20) == 64  # large pages: the lower bound
    assert StorageConfig(path="/x", max_pending_pages=100).segment_pages_for(1024) == 100
    assert StorageConfig(path="/x", segment_pages=8).segment_pages_for(1024) == 8
    with pytest.raises(ValueError, match="page_bytes"):
        auto.segment_pages_for(0)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"backend": "s3"}, ValueError, "backend"),
        ({"backend": 3}, TypeError, "backend"),
        ({"backend": "file", "path": None}, ValueError, "path"),
        ({"path": 5}, TypeError, "path"),
        ({"capacity_bytes": -1}, ValueError, "capacity_bytes"),
        ({"capacity_bytes": 1.5}, TypeError, "capacity_bytes"),
        ({"segment_pages": 0}, ValueError, "segment_pages"),
        ({"segment_pages": True}, TypeError, "segment_pages"),
        ({"read_concurrency": 0}, ValueError, "read_concurrency"),
        ({"integrity": "crc"}, ValueError, "integrity"),
        ({"integrity_sample_rate": 0.0}, ValueError, "integrity_sample_rate"),
        ({"integrity_sample_rate": 1.5}, ValueError, "integrity_sample_rate"),
        ({"flush_interval_s": 0}, ValueError, "flush_interval_s"),
        ({"flush_interval_s": float("nan")}, ValueError, "flush_interval_s"),
        ({"prefetch_policy": "eager"}, ValueError, "prefetch_policy"),
        ({"prefetch_threshold_tokens": -5}, ValueError, "prefetch_threshold_tokens"),
        ({"prefetch_timeout_base_s": "1"}, TypeError, "prefetch_timeout_base_s"),
        ({"prefetch_timeout_max_s": 0.0}, ValueError, "prefetch_timeout_max_s"),
        ({"max_pending_pages": 4, "segment_pages": 8}, ValueError, "max_pending_pages"),
    ],
)
def test_validation_errors_name_the_field(kw, exc, match):
    kw.setdefault("path", "/tmp/x") if "path" not in kw else None
    with pytest.raises(exc, match=match):
        StorageConfig(**kw)


def test_from_dict_and_memory_needs_no_path(tmp_path):
    assert StorageConfig(backend="memory").path is None
    c = StorageConfig.from_dict({"backend": "file", "path": str(tmp_path), "prefetch_policy": "wait_complete"})
    assert c.prefetch_policy == "wait_complete"
    assert StorageConfig(backend="file", path=tmp_path).path == str(tmp_path)  # PathLike accepted
    with pytest.raises(ValueError, match="unknown keys"):
        StorageConfig.from_dict({"backend": "memory", "prefech_policy": "timeout"})
    with pytest.raises(TypeError):
        StorageConfig.from_dict([("backend", "memory")])
    with pytest.raises(TypeError):
        StorageConfig(backend="file", path="/x").prefetch_timeout(1.5)
