"""What the capture's records become, in a telemetry process or embedded."""
