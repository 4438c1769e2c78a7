"""statemachines."""
