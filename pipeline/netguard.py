"""Which hosts a recording may come from.

A recording URL comes from whoever submitted the job, so without this check it could make the worker
fetch from the cloud metadata service, a database on the private network, or its own loopback. Every
hop of a download is parsed (``pipeline.recording_url``), then its host resolved and checked here; the
downloader then connects to the checked address itself, so DNS cannot answer differently between the
check and the connection.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable

from pipeline.errors import BadRecording, DownloadError
from pipeline.recording_url import RecordingUrl
from worker.core.redact import withhold

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

# DOWNLOAD_ALLOW_PRIVATE_HOSTS opens loopback and private ranges for local runs. Link-local stays shut
# even then: 169.254.169.254 hands out the instance's cloud credentials.
LOCAL_RUN_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "::1/128", "fc00::/7")
)
# Carrier-grade NAT space: not private by RFC 1918, yet never reachable from the internet.
_SHARED = ipaddress.ip_network("100.64.0.0/10")
# IPv6 prefixes that carry an IPv4 address a gateway would forward to (NAT64 well-known prefix).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def describe_error(exc: BaseException, url: RecordingUrl) -> str:
    """A third-party exception as ``Type: message``, with ``url``'s query and fragment cut out."""
    return f"{type(exc).__name__}: {withhold(str(exc), url.secrets)}"


def refusal_reason(address: IPAddress, allowed_networks: Iterable[IPNetwork] = ()) -> str | None:
    """Why ``address`` may not be fetched from, or None when it is globally routable or allowed."""
    allowed = tuple(allowed_networks)
    if _in_any(address, allowed):
        return None
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        if _in_any(embedded, allowed):
            return None
        inner = refusal_reason(embedded)
        return None if inner is None else f"embeds {embedded}, which is {inner}"
    for reason, flagged in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("shared (carrier-grade NAT)", address.version == 4 and address in _SHARED),
        ("site-local", address.version == 6 and address.is_site_local),
        ("not globally routable", not address.is_global),
    ):
        if flagged:
            return reason
    return None


def default_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host``, in its order, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def checked_addresses(
    host: str, port: int, allowed_networks: Iterable[IPNetwork], resolver: Resolver | None = None
) -> list[str]:
    """Resolve ``host`` and return its addresses, refusing the host if ANY of them is not allowed.

    All of them, not just the first, because the connection may fall back to any address on the list.
    """
    resolve = resolver or default_resolver
    try:
        raw = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise DownloadError(f"could not resolve {host}: {type(exc).__name__}") from None
    if not raw:
        raise DownloadError(f"could not resolve {host}: no addresses")
    addresses: list[IPAddress] = []
    for text in raw:
        try:
            # A scope id (fe80::1%eth0) says which interface, not which host: the address decides.
            addresses.append(ipaddress.ip_address(text.split("%", 1)[0]))
        except ValueError:
            raise BadRecording(f"host {host} resolved to an unusable address") from None
    allowed = tuple(allowed_networks)
    for address in addresses:
        reason = refusal_reason(address, allowed)
        if reason is not None:
            raise BadRecording(f"host {host} resolves to {address} ({reason}): refused by the address policy")
    return [str(address) for address in addresses]


def _in_any(address: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    return any(address.version == net.version and address in net for net in networks)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, NAT64), which is where it leads."""
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
