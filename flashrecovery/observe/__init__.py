"""A live job's Prometheus metrics, folded from its log (the `metrics` command and the agent's
/metrics endpoint)."""
