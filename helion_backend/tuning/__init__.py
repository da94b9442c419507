"""Tuning: ``python -m helion_backend tune`` and ``autotune_missing``. Sits on top of the kernels, the
run time and the compile side's manifest."""
