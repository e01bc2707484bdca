"""Pallas kernels for hicache_jax (needs JAX). Each kernel family sits in its own folder beside
its pure-JAX reference, its tests and its benchmark."""
