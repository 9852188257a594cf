"""Kubernetes backend: InferenceGroups as LeaderWorkerSets (manifests.py renders, backend.py runs)."""
