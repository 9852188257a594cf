"""What a process tells about itself: Prometheus metrics through one registry module (metrics.py), and the
OpenTelemetry traces of the request path (tracing.py; `tideflow trace` reads them: trace_cli.py)."""
