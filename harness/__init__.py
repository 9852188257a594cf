"""Test and benchmark harnesses: a local Prometheus, a reference OpenAI server with set latencies, the
judge for healthy canaries on shared cores, the tidal-day replay, the DEP rank replay. Not part of the
package (pyproject ships engine, tideflow_kernels, tasks, flows); tests and benchmarks import them from the
repository."""
