"""The capture: what otel-hicache runs in the serving process (``submit()``/``ack()``, the
poller, device timing and clock placement) and the channel its records leave by."""
