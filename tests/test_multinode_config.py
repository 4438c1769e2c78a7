"""`flashrecovery run` and `control-plane` refuse a multi-node setup that can't work, before
starting anything, with a one-line reason (exit code 2)."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest

from flashrecovery.agent import rendezvous
from flashrecovery.agent.config import Endpoint
from flashrecovery.agent.launcher import default_node_rank
from flashrecovery.agent.store import JobStore
from flashrecovery.cli import main
from flashrecovery.errors import ConfigError

SCRIPT = Path(__file__).parent / "scripts" / "train_mlp.py"
SECRET = "0123456789abcdef0123"


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


@pytest.fixture
def log(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'log.db'}"


def run_args(log: str, *more: str) -> list[str]:
    return ["run", "--nproc-per-node", "2", "--log", log, *more, str(SCRIPT)]


def test_nodes_need_the_shared_secret(
    capsys: pytest.CaptureFixture[str], log: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLASHRECOVERY_STORE_PREFIX", raising=False)
    err = refused(capsys, *run_args(log, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1234"))
    assert "FLASHRECOVERY_STORE_PREFIX" in err


def test_an_embedded_log_is_refused_for_a_job_across_hosts(
    capsys: pytest.CaptureFixture[str], log: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLASHRECOVERY_STORE_PREFIX", SECRET)
    err = refused(capsys, *run_args(log, "--nnodes", "2", "--rdzv-endpoint", "10.1.2.3:29500"))
    assert "spans hosts" in err and "kafka://" in err
    err = refused(capsys, "control-plane", "--log", log, "--bind", "10.1.2.3:29500")
    assert "spans hosts" in err


@pytest.mark.parametrize(
    ("more", "reason"),
    [
        (["--nnodes", "2"], "need --rdzv-endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], "outside 0..1"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--node-wait", "90"], "--node-wait"),
    ],
)  # fmt: skip
def test_bad_node_options(
    capsys: pytest.CaptureFixture[str],
    log: str,
    monkeypatch: pytest.MonkeyPatch,
    more: list[str],
    reason: str,
) -> None:
    monkeypatch.setenv("FLASHRECOVERY_STORE_PREFIX", SECRET)
    assert reason in refused(capsys, *run_args(log, *more))


def test_a_node_that_finds_no_store_says_where_it_looked(
    capsys: pytest.CaptureFixture[str], log: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLASHRECOVERY_STORE_PREFIX", SECRET)
    monkeypatch.setattr(rendezvous, "JOIN_TIMEOUT", datetime.timedelta(seconds=1))
    err = refused(
        capsys,
        *run_args(log, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:9"),
    )
    assert "no job store at 127.0.0.1:9" in err


def test_node_ranks_are_claimed_once_and_auto_takes_the_lowest_free() -> None:
    store = JobStore.open(datetime.timedelta(seconds=5))  # a real store, on loopback
    for node in (0, 2):
        store.keys.set(f"rdzv/node/{node}", f"elsewhere:{node}")
    with pytest.raises(ConfigError, match="node rank 2 is taken by the agent elsewhere:2"):
        rendezvous._claim(store, 2)
    assert rendezvous._claim(store, None) == 1
    assert rendezvous._claim(store, None) == 1  # the same agent asking again keeps its rank
    store.keys.set("rdzv/node/3", "elsewhere:3")
    assert rendezvous._claim(store, 4) == 4


def test_an_agent_given_no_node_rank_is_node_0_only_where_it_can_host_the_store() -> None:
    """Omitted --node-rank: 0 for the agent that can listen on the endpoint, auto (None) for
    one on another host or after the store is up; with a control plane, 0 as before."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = Endpoint("127.0.0.1", held.getsockname()[1])
        assert default_node_rank(taken, control_plane=False) is None
        assert default_node_rank(taken, control_plane=True) == 0
    assert default_node_rank(taken, control_plane=False) == 0  # free again
    assert default_node_rank(Endpoint("192.0.2.1", 29500), control_plane=False) is None
    assert default_node_rank(None, control_plane=False) == 0
