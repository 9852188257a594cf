"""Custom ops for the engine's hot path: torch references plus compiled CPU/CUDA builds."""
