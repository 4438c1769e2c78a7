"""trainer_hooks."""
