"""The control plane: a long-running controller that owns the fleet, and the client every task uses."""
