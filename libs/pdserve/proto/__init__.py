"""Generated gRPC stubs live in ``pdserve.proto.v1`` (``make protos``); never edit them."""
