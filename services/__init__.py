"""pdserve services: each a separate process, ``python -m services.<name>``."""
