"""
Network addresses as the broker's log and answers show them.
"""


def formatHostPort(host, port):
    """
    C{host:port}, or C{[host]:port} for an IPv6 host.
    """
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def formatAddress(address):
    """
    C{host:port} of a Twisted address (C{[host]:port} for IPv6), the type
    name for anything else (a UNIX socket has no port to report).
    """
    host = getattr(address, "host", None)
    port = getattr(address, "port", None)
    if host is None or port is None:
        return type(address).__name__
    return formatHostPort(host, port)


def formatDatagramAddress(address):
    """
    C{host:port} (C{[host]:port} for IPv6) of a datagram's C{(host, port)}
    (or IPv6 C{(host, port, flowinfo, scope)}) address.
    """
    return formatHostPort(*address[:2])
