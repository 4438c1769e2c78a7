"""The agent: `flashrecovery run`, one per node; starts ranks and hot spares and carries out
the engine's decisions on them."""

from flashrecovery.agent.config import AgentConfig
from flashrecovery.agent.job import Agent
from flashrecovery.errors import ConfigError

__all__ = ["Agent", "AgentConfig", "ConfigError"]
