"""The long-running processes: the agent (`flashrecovery run`, one per node), which starts ranks
and hot spares and carries out the engine's decisions on them; the control plane; and the
engine as a service of its own (`flashrecovery engine`)."""

from flashrecovery.agent.config import AgentConfig
from flashrecovery.agent.job import Agent
from flashrecovery.errors import ConfigError

__all__ = ["Agent", "AgentConfig", "ConfigError"]
