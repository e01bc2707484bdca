"""The package's version, in one place: the wheel's metadata (``pyproject.toml``), ``hicache-jax
--version`` and the ``build_info`` metric read it. A module of its own so that the cache can read
it without importing the package's ``__init__`` (which imports the cache)."""

__version__ = "0.1.0"
