"""Which addresses a node publishes, and which of a remote's addresses are worth dialing.

Pure rules over IP literals and TCP multiaddr text (`/ip4/H/tcp/P`, `/ip6/H/tcp/P`,
`/dns|dns4|dns6/NAME/tcp/P`, each optionally ending in `/p2p/<peer id>`).

- A node never publishes an address nobody else can reach: not 0.0.0.0 (a remote that dials it
  reaches *itself* and fails the Noise handshake on the peer id), not multicast or broadcast,
  and not loopback unless loopback is all it has (every node of the swarm on this machine).
- A dialer skips what it cannot reach for the same reasons, plus its own listen addresses and
  other machines' loopback addresses, and keeps the reason for the one-line error it may print.
- Data-channel hosts (join requests and answers, hellos, swarm lists) are IP literals only: a
  name would make the learner resolve whatever a peer chose, and could not be checked here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_IP_PROTOS = ("ip4", "ip6")
_DNS_PROTOS = ("dns", "dns4", "dns6")
# RFC 1035: 253 characters; a label is 1-63 letters, digits or hyphens.
MAX_DNS_NAME = 253


class AddressError(ValueError):
    """Text that is not a usable address (the message says which part and why)."""


@dataclass(frozen=True, slots=True)
class TcpAddr:
    """One TCP multiaddr: `proto` is ip4, ip6, dns, dns4 or dns6."""

    proto: str
    host: str
    port: int
    peer_id: str | None = None

    def text(self, *, with_peer: bool = True) -> str:
        tail = f"/p2p/{self.peer_id}" if with_peer and self.peer_id else ""
        return f"/{self.proto}/{self.host}/tcp/{self.port}{tail}"


def ip_of(host: str) -> IPAddress | None:
    """The IP address `host` spells, or None if it is not an IP literal."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def proto_of(host: str) -> str:
    ip = ip_of(host)
    if ip is None:
        return "dns"
    return "ip4" if ip.version == 4 else "ip6"


def unroutable_reason(host: str) -> str | None:
    """Why no remote can ever reach `host` (an IP literal), or None. Names are not judged here."""
    ip = ip_of(host)
    if ip is None:
        return None
    if ip.is_unspecified:
        return "unspecified address (a listen wildcard, not a destination)"
    if ip.is_multicast:
        return "multicast address"
    if ip == ipaddress.IPv4Address("255.255.255.255"):
        return "broadcast address"
    if ip.version == 4 and ip in ipaddress.IPv4Network("240.0.0.0/4"):
        return "reserved address"
    if ip.version == 6 and ip.is_link_local:
        return "link-local address (needs an interface scope)"
    return None


def is_loopback(host: str) -> bool:
    ip = ip_of(host)
    return ip is not None and ip.is_loopback


def scope_of(host: str) -> str | None:
    """Which kind of network `host` (an IP literal) is on: "loopback", "link-local", "private"
    (RFC 1918, unique-local IPv6 and the like) or "public"; None for a name."""
    ip = ip_of(host)
    if ip is None:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    return "private" if ip.is_private else "public"


def dial_back_refusal(target: str, *, own_hosts: Collection[str], allow_private: bool = False) -> str | None:
    """Why a node must not dial `target` back for a remote that asked it to (None: it may).

    AutoNAT's rule: a node dials back only the address the request came from, so no remote can
    point it at a third party; and, as a second line, it dials a loopback, link-local or
    private address only when it has an address of that scope itself (a swarm on one machine
    or one LAN) or its operator allowed it (`allow_private`): a cloud's metadata service at
    169.254.169.254 or a LAN's hosts are never a remote's to choose."""
    reason = unroutable_reason(target)
    if reason is not None:
        return reason
    scope = scope_of(target)
    if scope is None:
        return "not an IP address"
    if scope == "public" or allow_private:
        return None
    if any(scope_of(h) == scope for h in own_hosts):
        return None
    return f"a {scope} address, and this node has none of that scope (allow it with net.dial_private)"


def check_port(port: object, *, where: str = "port") -> int:
    if type(port) is not int or not 1 <= port <= 65535:
        raise AddressError(f"{where}: {port!r} is not a TCP port (1-65535)")
    return port


def check_dns_name(name: str, *, where: str = "host") -> str:
    labels = name.rstrip(".").split(".")
    ok = 0 < len(name) <= MAX_DNS_NAME and all(
        0 < len(label) <= 63 and label.isascii() and label.replace("-", "").isalnum()
        and not label.startswith("-") and not label.endswith("-")
        for label in labels
    )
    if not ok:
        raise AddressError(f"{where}: {name[:80]!r} is not a DNS name")
    return name


def check_data_host(host: object, *, where: str = "host") -> str:
    """A data-channel host: a routable IP literal, returned in canonical form."""
    if not isinstance(host, str) or len(host) > 64:
        raise AddressError(f"{where}: expected an IP address, got {str(host)[:80]!r}")
    ip = ip_of(host)
    if ip is None:
        raise AddressError(f"{where}: {host!r} is not an IP address")
    reason = unroutable_reason(host)
    if reason is not None:
        raise AddressError(f"{where}: {host} is an {reason}")
    return str(ip)


def parse_tcp_multiaddr(text: str) -> TcpAddr:
    """Parse `/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT[/p2p/ID]`; AddressError otherwise."""
    if not isinstance(text, str) or len(text) > 512:
        raise AddressError("not a multiaddr string")
    parts = text.split("/")
    if len(parts) not in (5, 7) or parts[0] != "" or parts[3] != "tcp":
        raise AddressError(f"{text!r} is not a TCP multiaddr like /ip4/HOST/tcp/PORT[/p2p/ID]")
    proto, host, port_text = parts[1], parts[2], parts[4]
    if proto in _IP_PROTOS:
        ip = ip_of(host)
        if ip is None or (ip.version == 4) != (proto == "ip4"):
            raise AddressError(f"{text!r}: {host!r} is not an {proto} address")
        host = str(ip)
    elif proto in _DNS_PROTOS:
        check_dns_name(host, where=text)
    else:
        raise AddressError(f"{text!r}: unsupported protocol /{proto} (use ip4, ip6, dns, dns4 or dns6)")
    if not (port_text.isascii() and port_text.isdigit()):  # str.isdigit() also takes "²"
        raise AddressError(f"{text!r}: {port_text!r} is not a port")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise AddressError(f"{text!r}: port {port} is out of range")
    peer_id = None
    if len(parts) == 7:
        if parts[5] != "p2p" or not parts[6]:
            raise AddressError(f"{text!r}: expected /p2p/<peer id> after the port")
        peer_id = parts[6]
    return TcpAddr(proto, host, port, peer_id)


def check_announce(text: str) -> TcpAddr:
    """An operator's `--announce` multiaddr: parseable, routable, with a real port."""
    addr = parse_tcp_multiaddr(text)
    reason = unroutable_reason(addr.host)
    if reason is not None:
        raise AddressError(f"--announce {text}: {addr.host} is an {reason}; announce the address others dial")
    check_port(addr.port, where=f"--announce {text}")
    return addr


def publish_addrs(
    listening: Sequence[TcpAddr],
    *,
    announce: Sequence[TcpAddr] = (),
    advertise_host: str | None = None,
    interface_hosts: Sequence[str] = (),
) -> list[TcpAddr]:
    """What a node tells others, from the addresses its listeners actually hold.

    Order of precedence: explicit `announce` addresses as given; else each listener's port at
    `advertise_host`; else each listener's own host, with a wildcard replaced by this machine's
    `interface_hosts`. Unroutable results are dropped, and loopback ones too unless nothing else
    is left (a swarm on one machine).
    """
    if announce:
        return list(dict.fromkeys(TcpAddr(a.proto, a.host, a.port) for a in announce))
    out: list[TcpAddr] = []
    for addr in listening:
        ip = ip_of(addr.host)
        if advertise_host is not None:
            hosts: Sequence[str] = (advertise_host,)
        elif ip is not None and ip.is_unspecified:
            hosts = interface_hosts
        else:
            hosts = (addr.host,)
        out += [TcpAddr(proto_of(h), h, addr.port) for h in hosts if unroutable_reason(h) is None]
    remote = [a for a in out if not is_loopback(a.host)]
    return list(dict.fromkeys(remote or out))


def dial_plan(
    addrs: Sequence[str], *, own: Collection[tuple[str, int]], local_only: bool
) -> tuple[list[str], list[tuple[str, str]]]:
    """Split a remote's published addresses into (worth dialing, [(skipped, why)]).

    `own` is this node's (host, port) listen and publish pairs; `local_only` says this node
    itself publishes only loopback addresses, in which case other loopback addresses are the
    swarm's and are dialed.
    """
    dial: list[str] = []
    skipped: list[tuple[str, str]] = []
    for text in addrs:
        try:
            addr = parse_tcp_multiaddr(text)
        except AddressError as exc:
            skipped.append((text, f"not dialable: {exc}"))
            continue
        reason = unroutable_reason(addr.host)
        if reason is None and (addr.host, addr.port) in own:
            reason = "this node's own address"
        if reason is None and is_loopback(addr.host) and not local_only:
            reason = "loopback, which is the other machine's own interface"
        if reason is None:
            dial.append(text)
        else:
            skipped.append((text, reason))
    return dial, skipped
