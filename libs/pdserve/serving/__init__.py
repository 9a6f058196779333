"""What the prefill and decode services share: the engine thread, the KV bridge to the node's
kvd, the Engine admin servicer, proto conversion and instance registration."""
