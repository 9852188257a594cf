"""The host runtime every room stands on: the process supervisor, intra-op threads, the torch device, where state
lives (TIDEFLOW_HOME), the one HTTP client helper, argparse types and the errors a user can act on."""
