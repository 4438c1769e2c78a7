"""Reading a Prometheus endpoint the way Prometheus does: HTTP GET, then the text parser."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(url: str, timeout: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "job_id"))): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))
