"""The trainer hook: what a PyTorch training loop calls to survive rank failures (docs/hook.md).

session = init()
session.register(model, optimizer)
for step in session.steps(total):
    loss_fn(model(batch(step, session.rank))).backward()
    session.commit()
session.finish()
"""

from flashrecovery.errors import (
    FallbackRequired,
    JobFailed,
    LaunchError,
    ProtocolError,
    ReplacedError,
)
from flashrecovery.trainer_hooks.faults import InjectedFault
from flashrecovery.trainer_hooks.session import Session, Stateful, init, init_process_group

__all__ = [
    "FallbackRequired",
    "InjectedFault",
    "JobFailed",
    "LaunchError",
    "ProtocolError",
    "ReplacedError",
    "Session",
    "Stateful",
    "init",
    "init_process_group",
]
