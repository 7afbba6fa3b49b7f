"""
C{twistd dallal}: command-line options and the service they build.
"""

from twisted.python import usage

from dallal.acl import AclError
from dallal.auth import Gatekeeper
from dallal.core import DEFAULT_MAX_PAYLOAD, BrokerConfig
from dallal.passwords import PasswordFileError
from dallal.retained import StoreError
from dallal.delivery import SLOW_CONSUMER_POLICIES, DeliveryConfig
from dallal.keepalive import DEFAULT_INTERVAL
from dallal.service import DEFAULT_INTERFACE, DallalService
from dallal.sysstats import DEFAULT_INTERVAL as DEFAULT_SYS_INTERVAL
from dallal.udp import DEFAULT_ACK_TIMEOUT as DEFAULT_UDP_ACK_TIMEOUT

DEFAULT_TCP_PORT = 1373


def _positive(kind, zeroTurnsOff=False):
    """
    A converter of positive numbers of C{kind} for an option; with
    C{zeroTurnsOff}, 0 too, meaning the feature is off.
    """

    def convert(text):
        value = kind(text)
        if value < 0 or (value == 0 and not zeroTurnsOff):
            least = "positive or 0" if zeroTurnsOff else "positive"
            raise ValueError(f"must be {least}, got {text}")
        return value

    convert.coerceDoc = "0 turns it off." if zeroTurnsOff else "Must be positive."
    return convert


def _port(option):
    def convert(text):
        port = int(text)
        if not 0 <= port <= 65535:
            raise ValueError(f"{option}: port {port} is not in 0-65535")
        return port

    convert.coerceDoc = "A port number, 0 for any free port."
    return convert


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Dallal, a publish/subscribe message broker. With no options it "
        f"serves TCP clients on {DEFAULT_INTERFACE}:{DEFAULT_TCP_PORT}."
    )

    optParameters = [
        [
            "data-dir",
            None,
            "dallal-data",
            "Directory of the retained message store (created if missing).",
        ],
        [
            "interface",
            None,
            DEFAULT_INTERFACE,
            "Address that bare port numbers (and --udp) listen on "
            "(0.0.0.0 or :: to accept clients from other machines).",
        ],
        [
            "udp",
            None,
            None,
            "Also serve UDP clients on this port (the specification's is 1234)",
            _port("--udp"),
        ],
        [
            "udp-ack-timeout",
            None,
            DEFAULT_UDP_ACK_TIMEOUT,
            "Seconds to wait for a UDP client's ack before sending a message "
            "again (UDP loses datagrams: resend sooner than over TCP, for as "
            "long).",
            _positive(float),
        ],
        [
            "ping-interval",
            None,
            DEFAULT_INTERVAL,
            "Seconds between the server's pings to TCP clients, and between "
            "UDP clients' pings to it; a client that misses 3 in a row is "
            "dropped.",
            _positive(float),
        ],
        [
            "max-payload",
            None,
            DEFAULT_MAX_PAYLOAD,
            "Largest payload accepted, in bytes.",
            _positive(int),
        ],
        [
            "sys-interval",
            None,
            DEFAULT_SYS_INTERVAL,
            "Seconds between updates of the broker's statistics on its "
            "$SYS/broker/... topics.",
            _positive(float, zeroTurnsOff=True),
        ],
    ]

    _delivery = DeliveryConfig()
    optParameters += [
        [
            "max-inflight",
            None,
            _delivery.maxInflight,
            "Unacked messages in flight per client, in 'all' mode.",
            _positive(int),
        ],
        [
            "max-queued",
            None,
            _delivery.maxQueued,
            "Messages queued per client behind those in flight.",
            _positive(int),
        ],
        [
            "max-queued-bytes",
            None,
            _delivery.maxQueuedBytes,
            "Payload bytes queued per client behind those in flight.",
            _positive(int),
        ],
        [
            "slow-consumer",
            None,
            _delivery.slowConsumer,
            "What a full client queue costs: drop-oldest drops its oldest "
            "queued message, disconnect drops the client.",
        ],
        [
            "ack-timeout",
            None,
            _delivery.ackTimeout,
            "Seconds to wait for an ack before sending a message again.",
            _positive(float),
        ],
        [
            "max-attempts",
            None,
            _delivery.maxAttempts,
            "Sends of one message to one client before it is dropped unacked.",
            _positive(int),
        ],
    ]
    del _delivery

    optParameters += [
        [
            "passwords",
            None,
            None,
            "Clients must log in with a user name and password from this file "
            "(lines user:hash, made with dallal-passwd FILE USER).",
        ],
        [
            "acl",
            None,
            None,
            "Who may read and write which topics, in Mosquitto's acl_file format "
            "(user NAME, then topic [read|write|readwrite|deny] FILTER lines; "
            "pattern lines with %u and %c).",
        ],
    ]

    optFlags = [
        [
            "message-events",
            None,
            "Also log an event per message published, delivered, acked, "
            "replaced or dropped, for the log analytics in spark/; they cut "
            "throughput several times (docs/PERFORMANCE.md). Connections, "
            "subscriptions and errors are always logged.",
        ],
    ]

    def __init__(self):
        usage.Options.__init__(self)
        self["tcp"] = []

    def opt_tcp(self, value):
        """
        Where to serve TCP clients: a port number (on --interface) or a Twisted endpoint description such as tcp:1373:interface=0.0.0.0 or ssl:8883:privateKey=key.pem:certKey=cert.pem. Repeat it to listen on several. [default: 1373]
        """
        self["tcp"].append(value)

    def postOptions(self):
        if self["slow-consumer"] not in SLOW_CONSUMER_POLICIES:
            raise usage.UsageError(
                f"--slow-consumer must be one of {', '.join(SLOW_CONSUMER_POLICIES)}"
            )
        if not self["tcp"]:
            self["tcp"] = [str(DEFAULT_TCP_PORT)]
        self["tcp"] = [self._endpoint(value) for value in self["tcp"]]

    def _endpoint(self, value):
        if value.isdigit():
            port = int(value)
            if not 0 <= port <= 65535:
                raise usage.UsageError(f"--tcp: port {port} is not in 0-65535")
            interface = self["interface"].replace(":", "\\:")
            return f"tcp:{port}:interface={interface}"
        if ":" not in value:
            raise usage.UsageError(
                f"--tcp: {value!r} is neither a port number nor an endpoint "
                "description such as tcp:1373:interface=0.0.0.0"
            )
        return value


def makeService(options, reactor=None):
    """
    Build the broker service from parsed L{Options}.
    """
    if reactor is None:
        from twisted.internet import reactor
    config = BrokerConfig(
        maxPayload=options["max-payload"],
        messageEvents=bool(options["message-events"]),
        delivery=DeliveryConfig(
            maxInflight=options["max-inflight"],
            maxQueued=options["max-queued"],
            maxQueuedBytes=options["max-queued-bytes"],
            slowConsumer=options["slow-consumer"],
            ackTimeout=options["ack-timeout"],
            maxAttempts=options["max-attempts"],
        ),
    )
    try:
        gatekeeper = Gatekeeper.fromFiles(reactor, options["passwords"], options["acl"])
        service = DallalService(
            reactor,
            config,
            pingInterval=options["ping-interval"],
            dataDir=options["data-dir"],
            sysInterval=options["sys-interval"],
            gatekeeper=gatekeeper,
        )
    except (StoreError, PasswordFileError, AclError) as error:
        # twistd would show a traceback; the operator needs the reason.
        raise SystemExit(f"dallal: cannot start: {error}")
    for description in options["tcp"]:
        service.listenTCP(description)
    if options["udp"] is not None:
        service.listenUDP(
            options["udp"], options["interface"], ackTimeout=options["udp-ack-timeout"]
        )
    return service
