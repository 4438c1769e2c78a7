"""Every error flashrecovery raises on purpose, under one base.

None of them is a ``RuntimeError``: torch reports a failed collective or store wait as a
``RuntimeError`` (``torch.distributed.DistError`` included), and the hook treats exactly those as
a peer's failure. A log outage or a protocol bug must never be mistaken for one.
"""

from __future__ import annotations


class FlashRecoveryError(Exception):
    """Base of every error flashrecovery raises on purpose."""


class LogError(FlashRecoveryError):
    """The log cannot be reached or used (a clear message for the user, never a traceback)."""


class RecordError(FlashRecoveryError, ValueError):
    """A value that is not a valid record; ``reason`` names the field and what is wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConfigError(FlashRecoveryError, ValueError):
    """A bad argument: said plainly, before any process starts."""


class LaunchError(FlashRecoveryError):
    """The process was not started by `flashrecovery run` (or its environment is broken)."""


class BrokerError(FlashRecoveryError):
    """The project's Kafka broker could not be fetched, started or stopped."""


class Rejected(FlashRecoveryError, ValueError):
    """A valid record of a known type that makes no sense for its job now: counted with its
    reason by the engine, never applied."""


class IllegalTransition(FlashRecoveryError):
    """A machine was asked for a transition its state does not allow: a fault of whoever drives
    it (the engine, or the hook). When one machine was asked, ``machine``, ``trigger``,
    ``state`` and ``stamp`` (the record that asked, if any) say which and where."""

    def __init__(
        self,
        message: str,
        *,
        machine: str | None = None,
        trigger: str | None = None,
        state: str | None = None,
        stamp: object = None,
    ) -> None:
        super().__init__(message)
        self.machine, self.trigger, self.state, self.stamp = machine, trigger, state, stamp


class ScriptError(FlashRecoveryError):
    """The script uses torch.distributed or the hook in a way that cannot work under
    `flashrecovery run`; the message names the fix. No replacement would do better: the
    process says it is fatal (``RankExited.fatal``) and the engine fails the job at once."""


class NonFiniteStepError(ScriptError):
    """A step was NaN or infinite on its first attempt and on its recompute, and the job's
    ``--nonfinite-policy`` is fail: the message names the ranks and the step."""


class LostAfterTraining(ScriptError):
    """A collective the script runs after its training loop (its own checkpoint save, a final
    evaluation) lost a peer: recovery covers the training steps only, so what it computes would
    be wrong, and the job fails instead of writing it (docs/hook.md, "After the last step")."""

    def __init__(self, error: str) -> None:
        super().__init__(
            "a peer was lost after the job's last committed step, in a collective the script "
            f"runs after training ({error[:200]}): flashrecovery recovers the training steps "
            "only, and what this collective computes would be wrong; save checkpoints with "
            "`flashrecovery run --checkpoint-dir`, or before the last commit (docs/hook.md)"
        )


class ProtocolError(FlashRecoveryError):
    """The engine's plan contradicts this rank's state: a bug, never retried as a failure."""


class RestoreMismatch(FlashRecoveryError):
    """What a recipient received differs from what its lead donor said it sent (the bit sums of
    the state's tensors, trainer_hooks/transfer.py): ``donors`` sent the tensors that differ."""

    def __init__(self, donors: list[int], tensors: int, total: int) -> None:
        super().__init__(
            f"{tensors} of the {total} tensors received differ from what the donors sent "
            f"(sent by donor(s) {donors})"
        )
        self.donors, self.tensors = donors, tensors


class ReplacedError(FlashRecoveryError):
    """The engine replaced this rank (it was declared failed); this process must stop."""


class FallbackRequired(FlashRecoveryError):
    """The engine found no replica holding some shard: only a checkpoint can restore it."""


class Superseded(FlashRecoveryError):
    """A newer generation was planned while this rank waited in its own: the step is aborted
    and recomputed in the newer one."""


class JobFailed(FlashRecoveryError):
    """The engine decided the job has failed (for example a crash loop): stop training."""
