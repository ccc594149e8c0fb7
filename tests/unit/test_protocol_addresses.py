"""What a node publishes and what it dials: never a wildcard, loopback only among loopback nodes,
never its own listener; data hosts are routable IP literals and nothing else."""

from __future__ import annotations

import pytest

from protocol.addresses import (
    AddressError,
    TcpAddr,
    check_announce,
    check_data_host,
    dial_plan,
    parse_tcp_multiaddr,
    publish_addrs,
)

PID = "12D3KooWQkJNHoHCiLShw8kJQvxrthLQUwSu2MDZ1phF5ReRFk4C"


def tcp(host: str, port: int = 4001) -> TcpAddr:
    return parse_tcp_multiaddr(f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}")


def test_parse_round_trips_and_keeps_the_peer_id() -> None:
    a = parse_tcp_multiaddr(f"/ip4/10.0.0.7/tcp/4001/p2p/{PID}")
    assert (a.proto, a.host, a.port, a.peer_id) == ("ip4", "10.0.0.7", 4001, PID)
    assert a.text() == f"/ip4/10.0.0.7/tcp/4001/p2p/{PID}"
    assert parse_tcp_multiaddr("/dns4/learner.example.org/tcp/4001").host == "learner.example.org"
    assert parse_tcp_multiaddr("/ip6/2001:db8::1/tcp/1").proto == "ip6"


@pytest.mark.parametrize(
    "text",
    ["", "/ip4/10.0.0.1", "/ip4/10.0.0.1/udp/1", "/ip4/a..b/tcp/1", "/ip4/::1/tcp/1", "/ip6/10.0.0.1/tcp/1",
     "/ip4/10.0.0.1/tcp/65536", "/ip4/10.0.0.1/tcp/-1", "/ip4/10.0.0.1/tcp/x", "/dns4/a..b/tcp/1",
     "/dns4/-bad-/tcp/1", "/quic/1.2.3.4/tcp/1", "/ip4/10.0.0.1/tcp/1/ipfs/x", "/ip4/1.2.3.4/tcp/1/p2p/",
     "/dns/" + "a" * 300 + "/tcp/1", "/ip4/١.1.1.1/tcp/1"],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(AddressError):
        parse_tcp_multiaddr(text)


def test_a_wildcard_listener_publishes_the_advertised_host_with_its_port() -> None:
    out = publish_addrs([tcp("0.0.0.0", 4001)], advertise_host="203.0.113.5", interface_hosts=["10.0.0.2"])
    assert out == [tcp("203.0.113.5", 4001)]


def test_a_wildcard_listener_without_advertise_publishes_interfaces_not_loopback() -> None:
    out = publish_addrs([tcp("0.0.0.0", 4001)], interface_hosts=["10.0.0.2", "192.168.1.9", "127.0.0.1"])
    assert out == [tcp("10.0.0.2"), tcp("192.168.1.9")]


def test_loopback_is_published_only_when_it_is_all_there_is() -> None:
    assert publish_addrs([tcp("127.0.0.1", 5555)]) == [tcp("127.0.0.1", 5555)]
    assert publish_addrs([tcp("0.0.0.0", 5555)], interface_hosts=["127.0.0.1"]) == [tcp("127.0.0.1", 5555)]
    assert publish_addrs([tcp("0.0.0.0", 1)], interface_hosts=[]) == []  # never 0.0.0.0


def test_announce_wins_over_everything() -> None:
    announce = [check_announce("/dns4/learner.example.org/tcp/4001"), check_announce("/ip4/198.51.100.1/tcp/9000")]
    out = publish_addrs([tcp("0.0.0.0")], announce=announce, advertise_host="203.0.113.5", interface_hosts=["10.0.0.2"])
    assert [a.text() for a in out] == ["/dns4/learner.example.org/tcp/4001", "/ip4/198.51.100.1/tcp/9000"]


@pytest.mark.parametrize("text", ["/ip4/0.0.0.0/tcp/4001", "/ip4/224.0.0.1/tcp/1", "/ip4/1.2.3.4/tcp/0", "/ip6/::/tcp/1"])
def test_announce_refuses_what_nobody_can_dial(text: str) -> None:
    with pytest.raises(AddressError):
        check_announce(text)


def test_dial_plan_skips_the_unroutable_our_own_and_foreign_loopback() -> None:
    addrs = [f"/ip4/0.0.0.0/tcp/4001/p2p/{PID}", f"/ip4/127.0.0.1/tcp/4001/p2p/{PID}", f"/ip4/10.0.0.9/tcp/4001/p2p/{PID}",
             f"/ip4/10.0.0.2/tcp/4001/p2p/{PID}", "/memory/1", f"/ip4/10.0.0.7/tcp/4001/p2p/{PID}"]
    dial, skipped = dial_plan(addrs, own={("10.0.0.9", 4001)}, local_only=False)
    assert dial == [addrs[3], addrs[5]]
    reasons = dict(skipped)
    assert "unspecified" in reasons[addrs[0]]
    assert "loopback" in reasons[addrs[1]]
    assert "own address" in reasons[addrs[2]]
    assert "not dialable" in reasons["/memory/1"]


def test_dial_plan_on_loopback_dials_loopback_but_not_itself() -> None:
    addrs = ["/ip4/127.0.0.1/tcp/4001", "/ip4/127.0.0.1/tcp/4002"]
    dial, skipped = dial_plan(addrs, own={("127.0.0.1", 4002)}, local_only=True)
    assert dial == addrs[:1] and [a for a, _ in skipped] == addrs[1:]


@pytest.mark.parametrize("host", ["", "a..b", "learner.example", "0.0.0.0", "::", "255.255.255.255", "239.1.1.1",
                                  "fe80::1", "10.0.0.1 ", "1" * 100, None, 7, b"10.0.0.1", "240.0.0.1"])
def test_data_hosts_are_routable_ip_literals(host: object) -> None:
    with pytest.raises(AddressError):
        check_data_host(host)


def test_data_hosts_are_canonicalised() -> None:
    assert check_data_host("2001:DB8::1") == "2001:db8::1"
    assert check_data_host("127.0.0.1") == "127.0.0.1"
