"""Who wrote a record: each writer signs what it stores with a key of its own, and a reader
that holds the job's secret believes a record only if its signature is its claimed source's.

The hash chain (chain.py) proves order and completeness, not authorship: any process that can
append to the log could write a well-formed ``HealthReport`` about a healthy rank. So every key
is derived from the job's secret (FLASHRECOVERY_STORE_PREFIX, which only the job's agents,
engines and control plane hold; docs/protocol.md "Who may write"):

    K(job, source) = HMAC-SHA256(secret, "flashrecovery/v1/sign/<job>/<source>")

and a record's ``chain.mac`` is HMAC-SHA256(K(job, source), the record's stored bytes with the
mac's place filled by ``PLACEHOLDER``). The key names the source, so a record signed for one
source and claiming another fails like one signed with no key at all. Ranks and spares never
hold a key: their records reach the log through their agent's link (agent/links.py), and the
agent's log handle signs them.
"""

from __future__ import annotations

import hashlib
import hmac
import threading

from flashrecovery.records import Envelope

SECRET = "FLASHRECOVERY_STORE_PREFIX"  # where a job's process may find the secret
MAC_CHARS = 64  # hex of a SHA-256
PLACEHOLDER = "0" * MAC_CHARS  # where the mac goes while the mac is computed
_FIELD = b'"mac":"'
# A new source is rare (each rank, spare, agent and engine once), so the keys are kept; this
# bounds them against a reader fed an endless run of forged source names.
MAX_KEYS = 1 << 16


class Keyring:
    """The job's writer keys, derived from its secret on first use (docstring above)."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a keyring needs the job's secret")
        self._secret = secret.encode()
        self._keys: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "Keyring(***)"  # the secret is never shown

    def key(self, job_id: str, source: str) -> bytes:
        found = self._keys.get((job_id, source))
        if found is not None:
            return found
        label = f"flashrecovery/v1/sign/{job_id}/{source}".encode()
        key = hmac.digest(self._secret, label, hashlib.sha256)
        with self._lock:
            if len(self._keys) >= MAX_KEYS:
                self._keys.clear()
            self._keys[(job_id, source)] = key
        return key

    def sign(self, job_id: str, source: str, unsigned: bytes) -> bytes:
        """``unsigned`` (a record dumped with ``chain.mac == PLACEHOLDER``) with its mac in."""
        mac = hmac.digest(self.key(job_id, source), unsigned, hashlib.sha256).hex()
        return unsigned.replace(_FIELD + PLACEHOLDER.encode(), _FIELD + mac.encode(), 1)

    def forgery(self, raw: bytes, record: Envelope) -> str | None:
        """Why the stored ``raw`` of ``record`` is not its claimed source's, or None if it is."""
        link = record.chain
        if link is None or not link.mac:
            return f"unsigned {record.type} claiming source {record.source!r}"
        if not link.writer.startswith(f"{record.source}/"):
            return f"{record.type} of source {record.source!r} in writer {link.writer!r}'s chain"
        stored = _FIELD + link.mac.encode()
        if raw.count(stored) != 1:
            return f"{record.type} claiming source {record.source!r}: its mac is not in one place"
        unsigned = raw.replace(stored, _FIELD + PLACEHOLDER.encode(), 1)
        mac = hmac.digest(self.key(record.job_id, record.source), unsigned, hashlib.sha256)
        if not hmac.compare_digest(mac.hex(), link.mac):
            return f"{record.type} claiming source {record.source!r}: wrong signature"
        return None
