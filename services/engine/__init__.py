"""What the prefill and decode services share: their config, the engine instance (engine
thread, kvd bridge, admission, role), the Engine admin servicer, and the composition by role."""
