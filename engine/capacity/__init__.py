"""Capacity planning from measurements: what one role shape does (profile)."""
