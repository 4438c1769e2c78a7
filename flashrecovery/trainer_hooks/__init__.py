"""The trainer hook: what a PyTorch training loop calls to survive rank failures (docs/hook.md).

session = init()
session.register(model, optimizer)
for step in session.steps(total):
    loss_fn(model(batch(step, session.rank))).backward()
    session.commit()
session.finish()
"""

from flashrecovery.trainer_hooks.decisions import FallbackRequired
from flashrecovery.trainer_hooks.env import LaunchError
from flashrecovery.trainer_hooks.faults import InjectedFault
from flashrecovery.trainer_hooks.session import (
    ProtocolError,
    ReplacedError,
    Session,
    Stateful,
    init,
)

__all__ = [
    "FallbackRequired",
    "InjectedFault",
    "LaunchError",
    "ProtocolError",
    "ReplacedError",
    "Session",
    "Stateful",
    "init",
]
