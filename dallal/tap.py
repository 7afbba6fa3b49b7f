"""
C{twistd dallal}: command-line options and the service they build.
"""

import math
import resource
from dataclasses import replace

from twisted.logger import LogLevel
from twisted.python import usage

from dallal.acl import AclError
from dallal.auth import Gatekeeper
from dallal.bridge import parseBridge
from dallal.core import BrokerConfig
from dallal.origin import BrokerNameError, checkName
from dallal.passwords import PasswordFileError
from dallal.retained import StoreError
from dallal.delivery import SLOW_CONSUMER_POLICIES, DeliveryConfig
from dallal.keepalive import DEFAULT_INTERVAL
from dallal.limits import CONNECTIONS, MAX_CONTROL_LINE, MIN_CONTROL_LINE, fitToDescriptors
from dallal.service import DEFAULT_INTERFACE, DEFAULT_SHUTDOWN_GRACE, DallalService
from dallal.sysstats import DEFAULT_INTERVAL as DEFAULT_SYS_INTERVAL
from dallal.topics import MAX_TOPIC_LENGTH
from dallal.udp import DEFAULT_ACK_TIMEOUT as DEFAULT_UDP_ACK_TIMEOUT

DEFAULT_TCP_PORT = 1373


def _positive(kind, zeroTurnsOff=False):
    """
    A converter of positive numbers of C{kind} for an option; with
    C{zeroTurnsOff}, 0 too, meaning the feature is off.
    """

    def convert(text):
        value = kind(text)
        if not math.isfinite(value) or value < 0 or (value == 0 and not zeroTurnsOff):
            least = "positive or 0" if zeroTurnsOff else "positive"
            raise ValueError(f"must be {least}, got {text}")
        return value

    convert.coerceDoc = "0 turns it off." if zeroTurnsOff else "Must be positive."
    return convert


def _whole(option, minimum=1, maximum=None):
    """
    A whole number from C{minimum} to C{maximum} (if given), for one option:
    anything else stops twistd with one line naming the option.
    """
    bounds = f"of at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def convert(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            # A UsageError, not a ValueError: twistd would show the latter as
            # "Parameter type enforcement failed", without the option's name.
            raise usage.UsageError(f"--{option} must be a whole number {bounds}, not {text!r}")
        return value

    convert.coerceDoc = f"A whole number {bounds}."
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
            "name",
            None,
            None,
            "This broker's name among bridged brokers (letters, digits, '.', "
            "'_', '-'); by default one generated at the first start and kept "
            "in --data-dir.",
        ],
        [
            "sys-interval",
            None,
            DEFAULT_SYS_INTERVAL,
            "Seconds between updates of the broker's statistics on its "
            "$SYS/broker/... topics, and between the logged summaries of its "
            "traffic per topic.",
            _positive(float, zeroTurnsOff=True),
        ],
        [
            "shutdown-grace",
            None,
            DEFAULT_SHUTDOWN_GRACE,
            "Seconds a stopping broker waits for the messages in flight to be "
            "acked (it takes no new connections, publishes or subscriptions "
            "meanwhile); 0 closes every connection at once.",
            _positive(float, zeroTurnsOff=True),
        ],
    ]

    # Limits (README.md, "Limits"): each refusal is answered, counted and
    # logged (dallal.limits).
    _config = BrokerConfig()
    optParameters += [
        [
            "max-connections",
            None,
            _config.maxConnections,
            "TCP connections at once; more are answered ERR TOO_MANY_CLIENTS and "
            "closed. Lowered to what the descriptor limit (ulimit -n) allows.",
            _whole("max-connections"),
        ],
        [
            "max-connections-per-ip",
            None,
            _config.maxConnectionsPerIp,
            "TCP connections at once from one IP address (local clients all "
            "come from 127.0.0.1).",
            _whole("max-connections-per-ip"),
        ],
        [
            "max-udp-clients",
            None,
            _config.maxUdpClients,
            "UDP client sessions at once; a HELLO for one more is answered "
            "ERR TOO_MANY_CLIENTS.",
            _whole("max-udp-clients"),
        ],
        [
            "max-hellos-per-second",
            None,
            _config.maxHellosPerSecond,
            "UDP HELLOs per second from one IP address (as many at once after "
            "a quiet second); more are dropped unanswered.",
            _whole("max-hellos-per-second"),
        ],
        [
            "max-subscriptions",
            None,
            _config.maxSubscriptions,
            "Subscriptions per client.",
            _whole("max-subscriptions"),
        ],
        [
            "max-topic-length",
            None,
            _config.maxTopicLength,
            f"Longest topic or filter, in bytes (at most {MAX_TOPIC_LENGTH}: a UDP "
            "datagram has room for no longer).",
            _whole("max-topic-length", maximum=MAX_TOPIC_LENGTH),
        ],
        [
            "max-topic-levels",
            None,
            _config.maxTopicLevels,
            "Most levels in a topic or filter (a/b/c has 3).",
            _whole("max-topic-levels"),
        ],
        [
            "max-payload",
            None,
            _config.maxPayload,
            "Largest payload accepted, in bytes.",
            _whole("max-payload"),
        ],
        [
            "max-line",
            None,
            _config.maxControlLine,
            "Longest control line, in bytes; a longer one is answered ERR "
            "LINE_TOO_LONG and closes the connection.",
            _whole("max-line", MIN_CONTROL_LINE, MAX_CONTROL_LINE),
        ],
    ]
    del _config

    _delivery = DeliveryConfig()
    optParameters += [
        [
            "max-inflight",
            None,
            _delivery.maxInflight,
            "Unacked messages in flight per client, in 'all' mode.",
            _whole("max-inflight"),
        ],
        [
            "max-queued",
            None,
            _delivery.maxQueued,
            "Messages queued per client behind those in flight.",
            _whole("max-queued"),
        ],
        [
            "max-queued-bytes",
            None,
            _delivery.maxQueuedBytes,
            "Payload bytes queued per client behind those in flight.",
            _whole("max-queued-bytes"),
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
            _whole("max-attempts"),
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
            "replaced or dropped, for the log analytics' latency and loss "
            "account (dallal_analytics/); they cut "
            "throughput several times (docs/PERFORMANCE.md). Connections, "
            "subscriptions and errors are always logged.",
        ],
    ]

    def __init__(self):
        usage.Options.__init__(self)
        self["tcp"] = []
        self["bridge"] = []

    def opt_tcp(self, value):
        """
        Where to serve TCP clients: a port number (on --interface) or a Twisted endpoint description such as tcp:1373:interface=0.0.0.0 or ssl:8883:privateKey=key.pem:certKey=cert.pem. Repeat it to listen on several. [default: 1373]
        """
        self["tcp"].append(value)

    def opt_bridge(self, value):
        """
        Connect to another Dallal broker as a client and carry messages between them: NAME=ENDPOINT[,topics=FILTER;FILTER...][,direction=in|out|both], such as hub=tcp:hub.example:1373,topics=news/#;alerts/+,direction=both (the default: every topic, both ways). Repeatable.
        """
        self["bridge"].append(value)

    def postOptions(self):
        if self["slow-consumer"] not in SLOW_CONSUMER_POLICIES:
            raise usage.UsageError(
                f"--slow-consumer must be one of {', '.join(SLOW_CONSUMER_POLICIES)}"
            )
        if not self["tcp"]:
            self["tcp"] = [str(DEFAULT_TCP_PORT)]
        self["tcp"] = [self._endpoint(value) for value in self["tcp"]]
        if self["name"] is not None:
            try:
                checkName(self["name"])
            except ValueError as error:
                raise usage.UsageError(f"--name: {error}")
        self["bridge"] = self._bridges(self["bridge"])

    def _bridges(self, values):
        # twistd has installed its reactor by now: the endpoints are checked
        # with the one they will use.
        from twisted.internet import reactor

        bridges = []
        for value in values:
            try:
                bridge = parseBridge(value, reactor)
            except ValueError as error:
                raise usage.UsageError(f"--bridge {error}")
            if bridge.name in {other.name for other in bridges}:
                raise usage.UsageError(f"--bridge {bridge.name}: two bridges have this name")
            bridges.append(bridge)
        return bridges

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


def brokerConfig(options):
    """
    The broker's configuration from parsed L{Options}.
    """
    return BrokerConfig(
        maxConnections=options["max-connections"],
        maxConnectionsPerIp=options["max-connections-per-ip"],
        maxUdpClients=options["max-udp-clients"],
        maxHellosPerSecond=options["max-hellos-per-second"],
        maxSubscriptions=options["max-subscriptions"],
        maxTopicLength=options["max-topic-length"],
        maxTopicLevels=options["max-topic-levels"],
        maxPayload=options["max-payload"],
        maxControlLine=options["max-line"],
        messageEvents=bool(options["message-events"]),
        name=options["name"],
        delivery=DeliveryConfig(
            maxInflight=options["max-inflight"],
            maxQueued=options["max-queued"],
            maxQueuedBytes=options["max-queued-bytes"],
            slowConsumer=options["slow-consumer"],
            ackTimeout=options["ack-timeout"],
            maxAttempts=options["max-attempts"],
        ),
    )


def makeService(options, reactor=None, rlimit=resource):
    """
    Build the broker service from parsed L{Options}.

    @param rlimit: the C{resource} module, whose descriptor limit is raised
        to make room for C{--max-connections} (tests give a fake one).
    """
    if reactor is None:
        from twisted.internet import reactor
    config = brokerConfig(options)
    requested = config.maxConnections
    allowed, descriptors = fitToDescriptors(requested, rlimit)
    config = replace(config, maxConnections=allowed)
    try:
        gatekeeper = Gatekeeper.fromFiles(reactor, options["passwords"], options["acl"])
        service = DallalService(
            reactor,
            config,
            pingInterval=options["ping-interval"],
            dataDir=options["data-dir"],
            sysInterval=options["sys-interval"],
            gatekeeper=gatekeeper,
            shutdownGrace=options["shutdown-grace"],
        )
    except (StoreError, PasswordFileError, AclError, BrokerNameError) as error:
        # twistd would show a traceback; the operator needs the reason.
        raise SystemExit(f"dallal: cannot start: {error}")
    if allowed < requested:
        service.broker.events.emit(
            "limit_lowered",
            LogLevel.warn,
            limit=CONNECTIONS.name,
            max=allowed,
            requested=requested,
            descriptors=descriptors,
        )
    for description in options["tcp"]:
        service.listenTCP(description)
    if options["udp"] is not None:
        service.listenUDP(
            options["udp"], options["interface"], ackTimeout=options["udp-ack-timeout"]
        )
    for bridge in options["bridge"]:
        service.addBridge(bridge)
    return service
