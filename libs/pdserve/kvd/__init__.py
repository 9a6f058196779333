"""Engine side of the node's KV daemon: the block layout and the ``KvdClient``.

``client`` imports torch, so it is not imported here: ``from pdserve.kvd.client import
KvdClient``.
"""

from pdserve.kvd.layout import BlockLayout

__all__ = ["BlockLayout"]
