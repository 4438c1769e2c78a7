"""Kafka as the event log: one topic per stream, records keyed by job id.

A job's records share a partition (the key's murmur2 hash, as every Kafka client computes it),
so the partition offset is the record's position and their order is the log's order. Values are
the records' plain JSON bytes, readable by any Kafka tool.

URL: ``kafka://host:port[,host:port…][?topic_prefix=…&partitions=…&replication_factor=…
&timeout_s=…&<kafka-python setting>=…&producer.<setting>=…&consumer.<setting>=…]``; the same
settings may come from ``FLASHRECOVERY_KAFKA_<NAME>`` (``__`` for the dot), the URL winning.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import structlog
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    TopicAlreadyExistsError,
    UnknownBrokerIdError,
)
from kafka.partitioner.default import murmur2

from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.errors import LogError
from flashrecovery.records import Stream

log = structlog.get_logger("flashrecovery.kafka")
ENV_PREFIX = "FLASHRECOVERY_KAFKA_"
_NOT_CLIENT_ENV = {"CACHE"}  # FLASHRECOVERY_KAFKA_CACHE belongs to the broker runner
_CLIENTS = {"producer": KafkaProducer, "consumer": KafkaConsumer, "admin": KafkaAdminClient}
_CLIENT_DEFAULTS: dict[str, Mapping[str, Any]] = {
    name: client.DEFAULT_CONFIG for name, client in _CLIENTS.items()
}
RECONNECT_BACKOFF_MAX_MS = 1000
# A reader asks for a partition's end (or waits for a fetch) this long at a time, then makes its
# client ask again who leads it: kafka-python retries a request held by a leader gone (killed,
# paused, cut off) on that same leader until its metadata is refreshed, which nothing else asks
# for (5 min by default). A paused leader that also led the controllers is replaced after ~6 s:
# asked every 3 s, a reader learnt of it too late for its 10 s bound.
LEADER_ASK_S = 1.0
# How long an append given up on is looked for in the partition before the append fails.
END_LOOKUP_S = 3.0
# A decisions transaction waits this long between its steps when the broker is busy finishing
# the previous one (kafka-python's 100 ms made each decision cost ~120 ms; this, ~15 ms).
DECIDER_RETRY_BACKOFF_MS = 5
METADATA_WAIT_S = 0.1  # between two lookups the stale metadata failed at once
# A consumer's request not over this long after the longest a read asks for never will be: the
# consumer is given up.
STUCK_GRACE_S = 2.0
PRODUCER_LINGER_MS = 5
PRODUCER_BATCH_BYTES = 512 * 1024
CONSUMER_POLL_RECORDS = 5000
CONSUMER_FETCH_BYTES = 8 * 1024 * 1024
# The largest record the producer sends and the job's topics take (the broker's default is
# 1 MB). A regroup decision lists every member, about 6 bytes per rank: 1 MB is ~170,000 ranks.
RECORD_MAX_BYTES = 16 * 1024 * 1024  # below the producer's 32 MB buffer
MAX_REPLICAS = 3  # a topic's replicas when the URL names none: as many brokers as there are, to 3
_OWN = {"topic_prefix", "partitions", "replication_factor", "timeout_s"}
_SECRET = re.compile(r"((?:password|token|secret)[^=&]*=)[^&]*", re.IGNORECASE)


def redact(url: str) -> str:
    """The URL with secret values hidden, for messages."""
    return _SECRET.sub(r"\1***", url)


def _coerce(name: str, value: str, default: Any) -> Any:
    """A URL string as the type kafka-python expects for this setting; text stays untouched."""
    try:
        if isinstance(default, bool):
            if value.lower() not in {"true", "false", "1", "0", "yes", "no"}:
                raise ValueError(value)
            return value.lower() in {"true", "1", "yes"}
        if name == "acks" and value == "all":
            return value
        if isinstance(default, int | float):
            number = float(value)
            return int(number) if isinstance(default, int) and number.is_integer() else number
    except ValueError:
        raise LogError(
            f"Kafka setting {name}={value!r} is not a {type(default).__name__}"
        ) from None
    if default is None or isinstance(default, str):
        return value
    raise LogError(f"Kafka setting {name} cannot be given as text (it takes a Python object)")


@dataclass(frozen=True)
class KafkaSettings:
    """Everything a URL (and the environment) says, split per kafka-python client."""

    bootstrap: str
    topic_prefix: str = "flashrecovery."
    partitions: int = 1  # one total order per stream, like the embedded log; raise to scale
    replication_factor: int = 0  # 0: as many replicas as brokers, up to 3
    timeout_s: float = 10.0
    clients: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {name: {} for name in _CLIENT_DEFAULTS}
    )

    @classmethod
    def parse(cls, url: str, environ: Mapping[str, str] | None = None) -> KafkaSettings:
        parts = urlsplit(url)
        if parts.scheme != "kafka" or not parts.netloc or parts.path not in ("", "/"):
            raise LogError(
                f"Kafka log URL {redact(url)!r} is malformed: expected kafka://host:port"
            )
        env = os.environ if environ is None else environ
        options = {
            key[len(ENV_PREFIX) :].lower().replace("__", "."): value
            for key, value in env.items()
            if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :] not in _NOT_CLIENT_ENV
        }
        options.update(parse_qsl(parts.query, keep_blank_values=True))
        own: dict[str, Any] = {}
        clients: dict[str, dict[str, Any]] = {name: {} for name in _CLIENT_DEFAULTS}
        for key, value in options.items():
            if key in _OWN:
                own[key] = _coerce(key, value, cls.__dataclass_fields__[key].default)
                continue
            prefix, dot, name = key.partition(".")
            targets = [prefix] if dot and prefix in _CLIENT_DEFAULTS else list(_CLIENT_DEFAULTS)
            name = name if dot and prefix in _CLIENT_DEFAULTS else key
            accepting = [c for c in targets if name in _CLIENT_DEFAULTS[c]]
            if not accepting or name == "bootstrap_servers":
                raise LogError(
                    f"unknown Kafka setting {key!r} in {redact(url)!r}: use topic_prefix, "
                    "partitions, replication_factor, timeout_s, a kafka-python setting "
                    "(security_protocol, sasl_mechanism, ssl_cafile, …) or producer./consumer./"
                    "admin. followed by one"
                )
            for client in accepting:
                clients[client][name] = _coerce(name, value, _CLIENT_DEFAULTS[client][name])
        return cls(bootstrap=parts.netloc, clients=clients, **own)

    def config(self, client: str) -> dict[str, Any]:
        """The kwargs for one kafka-python client: our defaults, then the user's settings."""
        bound_ms = int(self.timeout_s * 1000)
        linger_ms = self.clients["producer"].get("linger_ms", PRODUCER_LINGER_MS)
        ours: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap.split(","),
            "client_id": f"flashrecovery-{client}",
            "bootstrap_timeout_ms": bound_ms,
            "request_timeout_ms": bound_ms,
            # A restarted broker is found again within a second (kafka-python backs off up to
            # 30 s), so heartbeats resume before the engine judges the silence of the outage.
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        }
        if client == "producer":
            # acks=all + idempotence: a retried send after a broker hiccup is stored once.
            ours |= {
                "acks": "all",
                "enable_idempotence": True,
                "max_block_ms": bound_ms,
                # kafka-python wants it at least request timeout + linger.
                "delivery_timeout_ms": bound_ms + linger_ms,
                # Records handed over without waiting (append_async) linger a little to go out
                # in bigger batches: fewer requests, less CPU per record. A writer that waits
                # (append, append_many) flushes, so it never waits for the linger. A big batch
                # means one wake-up of the producer's I/O thread per batch, not per 50 records
                # (bench/kafka_throughput.py); below the broker's 1 MB message limit.
                "linger_ms": linger_ms,
                "batch_size": PRODUCER_BATCH_BYTES,
                "max_request_size": RECORD_MAX_BYTES,
            }
        elif client == "consumer":
            ours |= {
                "group_id": None,
                "enable_auto_commit": False,
                "auto_offset_reset": "earliest",
                "allow_auto_create_topics": False,  # reading never creates (ensure_topics does)
                # A catch-up reads in big bites: fewer fetch round trips and poll calls.
                "max_poll_records": CONSUMER_POLL_RECORDS,
                "max_partition_fetch_bytes": CONSUMER_FETCH_BYTES,
                # A fenced engine's decisions (an aborted transaction) are never read.
                "isolation_level": "read_committed",
            }
        return ours | self.clients[client]

    def connect(self, client: str) -> Any:
        """A connected kafka-python client; a LogError when no broker answers (unreachable)
        or the broker refuses it."""
        try:
            return _CLIENTS[client](**self.config(client))
        except KafkaError as exc:
            if exc.retriable:  # nothing answered within the bound (a timeout, no broker)
                raise LogError(
                    f"Kafka at {self.bootstrap} is unreachable: no broker answered within "
                    f"{self.timeout_s} s ({exc})"
                ) from None
            raise LogError(f"Kafka at {self.bootstrap}: connecting failed: {exc!r}") from None

    def topic(self, stream: Stream) -> str:
        return f"{self.topic_prefix}{Stream(stream).value}"

    def decider_id(self, job_id: str) -> str:
        """The transactional id every engine of the job writes its decisions under: the
        broker lets only the one that registered it last commit (Kafka's zombie fencing)."""
        return f"{self.topic_prefix}{job_id}.decisions"


def _bump_epoch_on_reset(producer: KafkaProducer) -> None:
    """kafka-python (3.0.12) drops an idempotent producer's id when a batch it had sent
    expires (a leader cut off past the delivery bound) but never asks for a new one: every
    later send then waits for ever, and its writer falls silent (a chaos run's agent, its node
    declared lost). Kafka's own client bumps the producer's epoch there (KIP-360, brokers 2.5
    and later); so does this one. Private: kafka-python offers no public way."""
    manager = producer._transaction_manager
    reset = manager.reset_producer_id

    def bump_instead() -> None:
        if manager._supports_epoch_bump() and manager.has_producer_id():
            manager.bump_producer_id_and_epoch()
        else:
            reset()

    manager.reset_producer_id = bump_instead


def _commit_within(decider: KafkaProducer, bound_s: float) -> None:
    """Commit the open transaction, or raise KafkaTimeoutError after ``bound_s``.

    kafka-python (3.0.12) waits for a commit without a bound, and a commit in flight when
    its transaction coordinator restarts is never answered: the engine's thread would hang
    for good (a CI run's job, stopped by its harness, never recovered after a broker
    restart). Its own ``commit_transaction`` is ``begin_commit``, wake the sender, wait;
    this is the same with a bound. Private: kafka-python offers no public way."""
    result = decider._transaction_manager.begin_commit()
    decider._sender.wakeup()
    if not result.wait(timeout_ms=int(bound_s * 1000)):
        raise KafkaTimeoutError(f"the transaction's commit was not answered within {bound_s} s")


class ConsumerStuck(KafkaError):
    """A consumer's request did not end, not even by its own timeout: the consumer is given
    up and the next read makes a new one."""


def _bound_waits(consumer: KafkaConsumer, bound_s: float) -> None:
    """Make every wait of a caller's thread on ``consumer``'s IO thread end within ``bound_s``
    (then ConsumerStuck). kafka-python (3.0.12) hands each request to its IO thread and waits
    for it with no bound, and now and then the request never ends, not even by its own
    timeout: a standby engine waited in an end lookup with a 1 s timeout for over a minute;
    after a broker restart, an agent's engine and the test's reader waited in ``poll`` with
    the IO thread idle until their job was stopped. The wait here is the same hand-off as
    kafka-python's ``NetworkSelector.run`` (the request runs on the IO thread; the caller waits
    for an event) with a bound. Private: kafka-python offers no public way."""
    net = consumer._net
    unbounded = net.run

    def run(coro: Any, *args: Any) -> Any:
        if net._io_thread is None or threading.current_thread() is net._io_thread:
            return unbounded(coro, *args)  # no hand-off to wait for (or kafka-python's error)
        ended = threading.Event()
        outcome: dict[str, Any] = {}

        async def request() -> None:
            try:
                outcome["value"] = await net._invoke(coro, *args)
            except BaseException as exc:  # handed to the waiting thread, raised there
                outcome["error"] = exc
            finally:
                ended.set()

        net.call_soon_threadsafe(request)
        if not ended.wait(bound_s):
            raise ConsumerStuck(f"a request to Kafka did not end within {bound_s} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    net.run = run


def _close_at_once(producer: KafkaProducer) -> None:
    """Close without waiting, giving up what is unsent. kafka-python's ``close(timeout=0)``
    flushes first and raises KafkaTimeoutError while a batch is unanswered (its broker gone
    mid-transaction), leaving the producer open and its thread running. Private: kafka-python
    offers no public way."""
    try:
        producer.close(timeout=0)
    except KafkaTimeoutError:
        producer._accumulator.abort_incomplete_batches()
        producer.close(timeout=0)


@contextlib.contextmanager
def _failing_as_log_error(what: str, bootstrap: str) -> Iterator[None]:
    try:
        yield
    except KafkaError as exc:
        raise LogError(f"Kafka at {bootstrap}: {what} failed: {exc!r}") from None


def ensure_topics(settings: KafkaSettings) -> list[str]:
    """Create the missing stream topics; return the ones this call created."""
    topics = [settings.topic(s) for s in Stream]
    admin = settings.connect("admin")
    with _failing_as_log_error("creating topics", settings.bootstrap):
        try:
            missing = sorted(set(topics) - set(admin.list_topics()))
            if missing:
                brokers = admin.describe_cluster()["brokers"]
                serving = [b for b in brokers if not b.get("is_fenced")]
                replicas = settings.replication_factor or min(MAX_REPLICAS, len(serving))
                spec = {
                    "num_partitions": settings.partitions,
                    "replication_factor": replicas,
                    "configs": {
                        "max.message.bytes": str(RECORD_MAX_BYTES),
                        # acks=all waits for this many: one broker may be lost, none lost twice
                        "min.insync.replicas": str(max(1, replicas - 1)),
                    },
                }
                try:
                    admin.create_topics(
                        {t: spec for t in missing},
                        timeout_ms=int(settings.timeout_s * 1000),
                        wait_for_metadata=True,
                    )
                except TopicAlreadyExistsError:  # another process won the race
                    admin.wait_for_topics(missing, timeout_ms=int(settings.timeout_s * 1000))
        finally:
            admin.close()
    return missing


class KafkaLog(LogConnector):
    """Append with an idempotent acks=all producer; read by assigning the job's partition.
    ``read_only`` (events, replay): no producer, and topics that are missing are an error
    rather than created. A handle that fenced a job (``fence``) writes its decisions in a
    transaction of their own, under the job's one transactional id: an engine cut off with a
    decision in flight, superseded meanwhile, cannot have it stored when its link heals."""

    def __init__(self, url: str, settings: KafkaSettings, *, read_only: bool = False) -> None:
        super().__init__()
        self.url = url
        self.settings = settings
        # KafkaConsumer is not thread-safe, and threads that follow different streams (engine,
        # agent, hook) must not wait on each other's fetches: one consumer per thread.
        self._local = threading.local()
        self._consumers: list[KafkaConsumer] = []
        self._consumers_lock = threading.Lock()
        self._partitions: dict[str, list[int]] = {}
        self._partition_of: dict[tuple[str, bytes], int] = {}
        self._ends: dict[TopicPartition, int] = {}  # past this handle's last append, per partition
        self._producer: KafkaProducer | None = None
        # Per job this handle fenced: its transactional producer, None once a transaction
        # failed (fenced off, or its outcome unknown until the next fence settles it).
        self._deciders: dict[str, KafkaProducer | None] = {}
        self._unsent: list[BaseException] = []  # why append_async records were lost, for flush
        self._unsent_lock = threading.Lock()
        if not read_only:
            ensure_topics(settings)
        try:
            if not read_only:
                self._producer = settings.connect("producer")
                _bump_epoch_on_reset(self._producer)
            consumer = self._consumer  # connect now, so that a bad setting fails here
            if read_only:
                with self._failing("listing topics"):
                    self._require_topics(consumer.topics())
        except BaseException:
            self.close()
            raise

    def _require_topics(self, existing: set[str]) -> None:
        """A reader's log must exist: its missing topics are an error, never created."""
        missing = sorted({self.settings.topic(s) for s in Stream} - existing)
        if missing:
            raise LogError(
                f"no log at {redact(self.url)}: Kafka at {self.settings.bootstrap} has no "
                f"topic {', '.join(missing)} (nothing was written there; check topic_prefix)"
            )

    @property
    def _consumer(self) -> KafkaConsumer:
        consumer: KafkaConsumer | None = getattr(self._local, "consumer", None)
        if consumer is None:
            consumer = self.settings.connect("consumer")
            _bound_waits(consumer, self.settings.timeout_s + STUCK_GRACE_S)
            self._local.consumer = consumer
            with self._consumers_lock:
                self._consumers.append(consumer)
        return consumer

    def _give_up_consumer(self) -> None:
        """This thread's consumer is stuck: the next read makes a new one. The old one is
        closed on a thread of its own (closing fails the requests it left hanging), so that
        what ends the stuck request cannot hold this thread up."""
        consumer, self._local.consumer = getattr(self._local, "consumer", None), None
        if consumer is None:
            return
        with self._consumers_lock:
            self._consumers.remove(consumer)
        threading.Thread(
            target=consumer.close, kwargs={"timeout_ms": 0}, name="stuck-consumer", daemon=True
        ).start()

    @property
    def write_hold_s(self) -> float:
        """A request to a broker cut off is waited out for the request timeout, then sent to
        the partition's new leader; the wait and the metadata refresh together (a second). An
        append given up on is looked for in the partition (END_LOOKUP_S) before it fails."""
        return self.settings.timeout_s + END_LOOKUP_S + 1.0

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False) -> KafkaLog:
        return cls(url, KafkaSettings.parse(url), read_only=read_only)

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        with _failing_as_log_error(what, self.settings.bootstrap):
            try:
                yield
            except ConsumerStuck:
                self._give_up_consumer()
                raise

    def _job_partition(self, topic: str, key: bytes) -> TopicPartition:
        return TopicPartition(topic, self._partition(topic, key))

    def _partition(self, topic: str, key: bytes) -> int:
        """The key's partition as Kafka's default partitioner picks it (so reads find it);
        remembered, since murmur2 runs in Python and a writer asks once per record."""
        partition = self._partition_of.get((topic, key))
        if partition is None:
            if topic not in self._partitions:
                found = (
                    self._consumer.partitions_for_topic(topic)
                    if self._producer is None
                    else self._producer.partitions_for(topic)
                )
                self._partitions[topic] = sorted(found)
            partitions = self._partitions[topic]
            partition = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
            self._partition_of[(topic, key)] = partition
        return partition

    def append_raw(self, stream: Stream, job_id: str, raw: bytes) -> int:
        [offset] = self.append_raw_many(stream, job_id, [raw])
        return offset

    def append_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], *, routine: bool = False
    ) -> list[int]:
        """Send the whole batch (the producer packs it into few requests, acks=all and
        idempotent as ever), then wait once for every acknowledgement. (Kafka's followers
        fetch what is there: ``routine`` changes nothing.)"""
        topic, key = self.settings.topic(stream), job_id.encode()
        if stream is Stream.DECISIONS and job_id in self._deciders:
            return self._decide(job_id, raws)
        with self._failing(f"appending to {topic}"):
            tp = self._job_partition(topic, key)
            since = self._end_before(tp)
            try:
                offsets = self._settled(self._send_to(tp, key, raws))
            except KafkaError as exc:
                offsets = self._stored_anyway(tp, key, since, raws, exc)
            self._ends[tp] = max(self._ends.get(tp, 0), offsets[-1] + 1)
            return offsets

    def fence(self, job_id: str) -> None:
        self._producer_or_fail()  # a read-only handle decides nothing
        self._drop_decider(job_id)
        config = self.settings.config("producer") | {
            "transactional_id": self.settings.decider_id(job_id),
            "retry_backoff_ms": DECIDER_RETRY_BACKOFF_MS,
        }
        with self._failing(f"fencing the decisions of job {job_id}"):
            decider = KafkaProducer(**config)
            try:
                decider.init_transactions()  # aborts the transaction a predecessor left open
            except BaseException:
                _close_at_once(decider)
                raise
        self._deciders[job_id] = decider

    def _decide(self, job_id: str, raws: list[bytes]) -> list[int]:
        """One transaction for the batch; any failure leaves its outcome to the next fence."""
        decider = self._deciders[job_id]
        topic = self.settings.topic(Stream.DECISIONS)
        if decider is None:
            raise LogError(
                f"Kafka at {self.settings.bootstrap}: a decision of job {job_id} failed before: "
                "this handle writes none until it fences the job again"
            )
        key = job_id.encode()
        try:
            decider.begin_transaction()
            futures = [
                decider.send(
                    topic, value=bytes(raw), key=key, partition=self._partition(topic, key)
                )
                for raw in raws
            ]
            _commit_within(decider, self.settings.timeout_s)
            return [int(future.get(timeout=self.settings.timeout_s).offset) for future in futures]
        except KafkaError as exc:
            self._drop_decider(job_id)
            self._deciders[job_id] = None
            raise LogError(
                f"Kafka at {self.settings.bootstrap}: deciding for job {job_id} failed "
                f"({exc!r}); stored or not, the next fence settles it"
            ) from None

    def _drop_decider(self, job_id: str) -> None:
        decider = self._deciders.pop(job_id, None)
        if decider is not None:
            _close_at_once(decider)

    def _settled(self, futures: list[Any]) -> list[int]:
        """Each send's offset once the producer settled it (raises if it gave one up)."""
        self._producer_or_fail().flush()  # no linger: out now (with what others queued)
        # The producer settles every send within its delivery timeout: wait that long so the
        # answer is final (a give-up earlier could be stored later and then retried).
        wait_s = self._producer_or_fail().config["delivery_timeout_ms"] / 1000 + 5
        return [int(future.get(timeout=wait_s).offset) for future in futures]

    def _end_before(self, tp: TopicPartition) -> int:
        """An offset at or before where a batch sent now will land: the end after this
        handle's last append there (the partition's end asked once, before its first)."""
        if tp not in self._ends:
            ends = self._end_offsets(self._consumer, [tp], self.settings.timeout_s)
            self._ends[tp] = ends[tp]
        return self._ends[tp]

    def _stored_anyway(
        self, tp: TopicPartition, key: bytes, since: int, raws: list[bytes], failure: KafkaError
    ) -> list[int]:
        """The offsets of a batch the producer gave up on that the partition holds anyway (an
        acknowledgement lost with a leader, the records on the new one): sent again by the
        caller's retry, it would be stored twice. Its part that is missing is sent again now;
        raises the producer's error when the partition holds none of it, or cannot say."""
        try:
            with self._failing("looking for an append given up on"):
                held = {
                    bytes(rec.value): rec.offset
                    for rec in self._records({tp: since}, key, time.monotonic(), END_LOOKUP_S)
                }
        except LogError:
            raise failure from None
        stored = [held[raw] for raw in itertools.takewhile(held.__contains__, raws)]
        if not stored:
            raise failure
        log.warning("an append the producer gave up on was stored", records=len(stored))
        rest = raws[len(stored) :]
        return stored + (self._settled(self._send_to(tp, key, rest)) if rest else [])

    def send_raw_many(
        self, stream: Stream, job_id: str, raws: list[bytes], lost: Callable[[], None]
    ) -> None:
        """Into the producer's buffer and on: its I/O thread sends and retries (acks=all,
        idempotent) while the caller goes on; a record it gives up on is counted for flush."""
        for future in self._send(stream, job_id, raws):
            future.add_errback(self._lost, lost)

    def _lost(self, lost: Callable[[], None], exc: BaseException) -> None:
        with self._unsent_lock:
            self._unsent.append(exc)
        lost()

    def _send(self, stream: Stream, job_id: str, raws: list[bytes]) -> list[Any]:
        """Hand each record to the producer (in order, to the job's partition)."""
        topic, key = self.settings.topic(stream), job_id.encode()
        with self._failing(f"appending to {topic}"):
            return self._send_to(self._job_partition(topic, key), key, raws)

    def _send_to(self, tp: TopicPartition, key: bytes, raws: list[bytes]) -> list[Any]:
        producer = self._producer_or_fail()
        return [
            producer.send(tp.topic, value=bytes(raw), key=key, partition=tp.partition)
            for raw in raws
        ]

    def _producer_or_fail(self) -> KafkaProducer:
        if self._producer is None:
            raise LogError(f"log {redact(self.url)} was opened read-only")
        return self._producer

    def flush(self, timeout: float | None = None) -> None:
        if self._producer is None:
            return
        with self._failing("flushing"):
            self._producer.flush(timeout=timeout)
        with self._unsent_lock:
            unsent, self._unsent = self._unsent, []
        if unsent:
            raise LogError(
                f"Kafka at {self.settings.bootstrap}: {len(unsent)} record(s) handed over "
                "without waiting were not stored (lost; or, sent to a leader that stopped "
                f"answering, stored unacknowledged): {unsent[0]!r}"
            )

    def read(
        self, stream: Stream, job_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Entry]:
        return self._entries(stream, job_id, from_position, limit, wait_s=0.0)

    def follow(
        self,
        stream: Stream,
        job_id: str,
        from_position: int,
        timeout: float,
        *,
        wake_on_routine: bool = True,
    ) -> list[Entry]:
        return self._entries(stream, job_id, from_position, None, wait_s=timeout)

    def _entries(
        self, stream: Stream, job_id: str, start: int, limit: int | None, wait_s: float
    ) -> list[Entry]:
        topic, key = self.settings.topic(stream), job_id.encode()
        out: list[Entry] = []
        with self._failing(f"reading {topic}"):
            tp = self._job_partition(topic, key)
            for rec in self._records({tp: start}, key, time.monotonic() + wait_s):
                if limit is not None and len(out) >= limit:
                    break
                out.append(Entry.decode(rec.offset, rec.value or b"", Stream(stream)))
        return out

    def _records(
        self,
        starts: dict[TopicPartition, int],
        key: bytes | None,
        wait_until: float,
        bound_s: float | None = None,
    ) -> Iterator[Any]:
        """Records (with this key, if given) from each start up to the current end; if none,
        wait until ``wait_until`` for one. LogError if reading makes no progress in ``bound_s``
        (timeout_s when None)."""
        bound_s = self.settings.timeout_s if bound_s is None else bound_s
        consumer = self._consumer
        if consumer.assignment() != set(starts):
            consumer.assign(list(starts))
        ends = self._end_offsets(consumer, list(starts), bound_s)
        for tp, start in starts.items():
            # Re-seeking drops the fetch in flight: a follower that continues where it stopped
            # would then wait out the broker's fetch_max_wait_ms.
            if consumer.position(tp) != min(max(start, 0), ends[tp]):
                consumer.seek(tp, min(max(start, 0), ends[tp]))
        found, progress_at = False, time.monotonic()
        asked_at = progress_at
        while True:
            behind = any(consumer.position(tp) < ends[tp] for tp in starts)
            now = time.monotonic()
            if not behind and (found or now >= wait_until):
                return
            if behind and now - progress_at > bound_s:
                raise LogError(
                    f"Kafka at {self.settings.bootstrap}: no progress reading "
                    f"{sorted(tp.topic for tp in starts)} in {bound_s} s"
                )
            if behind and now - asked_at >= LEADER_ASK_S:
                # A fetch held by a leader gone waits out the request timeout (the whole bound)
                # and blocks the next fetch there: ask who leads now, the fetch goes to them.
                consumer._client.cluster.request_update()  # private: no public way to ask
                asked_at = now
            # At most LEADER_ASK_S a poll (the loop polls again): a wait longer than a
            # consumer's bound on its requests would be taken for a stuck consumer.
            budget = min(
                bound_s - (now - progress_at) if behind else wait_until - now, LEADER_ASK_S
            )
            for tp, records in consumer.poll(timeout_ms=max(1, int(budget * 1000))).items():
                progress_at = asked_at = time.monotonic()
                for rec in records:
                    ends[tp] = max(ends[tp], rec.offset + 1)
                    if rec.offset >= starts[tp] and (key is None or rec.key == key):
                        found = True
                        yield rec

    @staticmethod
    def _end_offsets(
        consumer: KafkaConsumer, partitions: list[TopicPartition], bound_s: float
    ) -> dict[TopicPartition, int]:
        """Each partition's end within ``bound_s``, asked LEADER_ASK_S at a time, the leaders
        looked up anew between two asks (the broker a lookup waits on may be gone). Metadata
        that still names a broker gone from it (killed, then dropped by its controllers:
        UnknownBrokerIdError, which kafka-python does not retry) is looked up anew too."""
        deadline = time.monotonic() + bound_s
        while True:
            left_s = deadline - time.monotonic()
            try:
                ends: dict[TopicPartition, int] = consumer.end_offsets(
                    partitions, max(1, int(min(LEADER_ASK_S, left_s) * 1000))
                )
                return ends
            except (KafkaTimeoutError, UnknownBrokerIdError) as exc:
                if left_s <= LEADER_ASK_S:
                    raise
                consumer._client.cluster.request_update()  # private: no public way to ask
                if isinstance(exc, UnknownBrokerIdError):  # raised at once: let the answer come
                    time.sleep(METADATA_WAIT_S)

    def jobs(self) -> list[str]:
        with self._failing("listing jobs"):
            starts = {
                TopicPartition(topic, p): 0
                for topic in (self.settings.topic(s) for s in Stream)
                for p in self._consumer.partitions_for_topic(topic) or ()
            }
            keys = {rec.key for rec in self._records(starts, None, 0.0) if rec.key}
        return sorted(k.decode(errors="replace") for k in keys)

    def close(self) -> None:
        for job_id in list(self._deciders):
            self._drop_decider(job_id)
        if self._producer is not None:
            try:
                self._producer.close(timeout=self.settings.timeout_s)
            except KafkaError as exc:  # what it still held is lost: said, not a traceback
                log.warning("records not stored before the log was closed", error=repr(exc))
                # private: kafka-python's close flushes first, so it would only raise again
                self._producer._sender.force_close()
        with self._consumers_lock:
            for consumer in self._consumers:
                consumer.close()
            self._consumers.clear()
