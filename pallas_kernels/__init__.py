"""Pallas kernels for a paged KV cache (needs JAX). Each kernel family sits in its own folder beside
its pure-JAX reference, its tests and its benchmark.

Dependencies point one way: the cache manager drives these kernels, and nothing in this
package imports it (``test_page_copy`` checks that)."""
