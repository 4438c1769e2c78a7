"""Views of a job from its log: Prometheus metrics, a timeline picture, what-if replay."""
