"""What a process tells about itself: Prometheus metrics through one registry module."""
