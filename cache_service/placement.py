"""Where a state-tier entry lives when several cache-service instances share one Redis.

Rendezvous (highest-random-weight) hashing: each instance scores each entry key,

    score(instance, key) = first 8 bytes of sha256("hybridserve/placement/v1\\0" ‖ instance ‖ \\0 ‖ key)

and the entry's instances are the highest-scored ones, best first. Every client that knows the
same instances computes the same order with no central lookup; an instance added or removed
moves only the keys it wins or held (~1/N of them), the others keep their place:

    key k:   inst-a 0x91..   inst-b 0x17..   inst-c 0xe4..      order: c, a, b
    c gone:  inst-a 0x91..   inst-b 0x17..                      order: a, b   (k's copy on a stays)

The key is the conversation's hash (`ConversationRef.key`): a conversation has one entry. A prefix
checkpoint's is `prefix_key(scope tag, name)`, which no conversation hash can equal.

An instance is named by its "host:port" address. A restarted pod comes back with a new address
and an empty tier: it is a new instance, as it should be.

Where the instances come from (`parse_targets`): a comma-separated list of addresses, each one
instance; an entry `dns:///name:port` stands for every address the name resolves to (a Kubernetes
headless Service: one A record per ready pod).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DNS_SCHEME = "dns:///"


def score(instance: str, key: str) -> int:
    digest = hashlib.sha256(b"hybridserve/placement/v1\0" + instance.encode() + b"\0" + key.encode()).digest()
    return int.from_bytes(digest[:8], "big")


def prefix_key(scope_tag: str, name: str) -> str:
    """The placement key of a prefix checkpoint (cache.proto PrefixStateKey)."""
    return f"prefix:{scope_tag}:{name}"


def rank(key: str, instances: Iterable[str]) -> list[str]:
    """The instances in the entry's order, best first (ties, never seen in practice, by name)."""
    return sorted(instances, key=lambda inst: (score(inst, key), inst), reverse=True)


@dataclass(frozen=True)
class Targets:
    """A client's configured instances: fixed addresses and DNS names to resolve."""

    addresses: tuple[str, ...] = ()
    dns_names: tuple[tuple[str, int], ...] = ()  # (host, port)

    @property
    def single(self) -> bool:
        """One plain address: the client behaves as it always did (gRPC resolves the name)."""
        return len(self.addresses) == 1 and not self.dns_names


def parse_targets(spec: str) -> Targets:
    """`"a:50051"`, `"a:50051,b:50051"`, `"dns:///cache-peers:50051"` or a mix; ValueError if
    an entry is not host:port."""
    addresses, names = [], []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.startswith(DNS_SCHEME):
            host, port = _host_port(entry[len(DNS_SCHEME):])
            names.append((host, port))
        else:
            _host_port(entry)
            addresses.append(entry)
    if not addresses and not names:
        raise ValueError(f"no cache-service address in {spec!r}")
    return Targets(tuple(dict.fromkeys(addresses)), tuple(dict.fromkeys(names)))


def _host_port(entry: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"cache-service address {entry!r} is not host:port")
    return host.strip("[]"), int(port)


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def addresses_of(infos: Sequence[tuple], port: int) -> list[str]:
    """Instance addresses from getaddrinfo's answer (one per distinct IP)."""
    return list(dict.fromkeys(address(info[4][0], port) for info in infos
                              if info[0] in (socket.AF_INET, socket.AF_INET6)))
