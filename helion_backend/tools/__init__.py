"""User commands on top of everything: ``python -m helion_backend explain`` and ``bisect``."""
