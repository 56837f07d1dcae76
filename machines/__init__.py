"""Declared machines, the compiled runtime, the event bus and timers. No I/O."""
