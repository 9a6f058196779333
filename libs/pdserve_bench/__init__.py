"""pdserve's benchmarks (``pdserve bench ...``), an optional extra: ``pdserve[bench]``.

Nothing in ``pdserve`` or ``services`` imports this package; service images do not carry it.
"""
