"""Benchmarks of the helion_inductor backend; shared measurement helpers live in :mod:`benchmarks.common`."""
