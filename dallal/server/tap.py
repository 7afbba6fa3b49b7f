"""
C{twistd dallal}: command-line options and the service they build.
"""

import gc
import os
import resource
import sys
from dataclasses import replace

from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    globalLogPublisher,
)
from twisted.python import usage

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import SLOW_CONSUMER_POLICIES, DeliveryConfig
from dallal.broker.origin import BrokerNameError
from dallal.broker.retained import StoreError
from dallal.broker.sysstats import DEFAULT_INTERVAL as DEFAULT_SYS_INTERVAL
from dallal.limits import (
    CONNECTIONS,
    DEFAULT_MAX_OFFLINE_BYTES,
    DEFAULT_MAX_OFFLINE_SESSIONS,
    MAX_CONTROL_LINE,
    MIN_CONTROL_LINE,
    fitToDescriptors,
)
from dallal.names import checkBrokerName
from dallal.numbers import MAX_PORT, positiveNumber
from dallal.security.acl import AclError
from dallal.security.auth import Gatekeeper
from dallal.security.passwords import PasswordFileError
from dallal.server.bridge import parseBridge
from dallal.server.config import (
    ConfigError,
    aboutOption,
    applyConfig,
    commandLineNames,
    inFile,
    readConfig,
    settingNames,
)
from dallal.server.keepalive import DEFAULT_INTERVAL
from dallal.server.service import DEFAULT_INTERFACE, DEFAULT_SHUTDOWN_GRACE, DallalService
from dallal.server.udp import DEFAULT_ACK_TIMEOUT as DEFAULT_UDP_ACK_TIMEOUT
from dallal.topics import MAX_TOPIC_LENGTH

DEFAULT_TCP_PORT = 1373

# The options a running broker takes again from its configuration file on
# SIGHUP (README.md, "Configuration"): those of the service's
# RELOADABLE_FIELDS, and the shutdown grace.
RELOADABLE_OPTIONS = frozenset(
    {
        "max-payload",
        "max-topic-length",
        "max-topic-levels",
        "max-subscriptions",
        "max-udp-clients",
        "max-udp-clients-per-ip",
        "max-inflight",
        "max-queued",
        "max-queued-bytes",
        "slow-consumer",
        "ack-timeout",
        "max-attempts",
        "message-events",
        "shutdown-grace",
    }
)


def _number(option, kind=int, zero=False, minimum=None, maximum=None, doc=None):
    """
    A converter of C{--option}'s value (L{positiveNumber}): a whole number
    (C{kind} C{int}) from C{minimum} (1 by default) to C{maximum}, or a
    positive C{float}; with C{zero}, 0 too, meaning the feature is off.
    Anything else stops twistd with one line naming the option: a
    L{usage.UsageError}, as twistd shows a ValueError as "Parameter type
    enforcement failed", without the option's name.
    """

    def convert(text):
        return positiveNumber(text, kind, zero, minimum, maximum, f"--{option}", usage.UsageError)

    if doc is None:
        if kind is float:
            doc = "0 turns it off." if zero else "Must be positive."
        elif maximum is None:
            doc = f"A whole number of at least {minimum or 1}."
        else:
            doc = f"A whole number from {minimum or 1} to {maximum}."
    convert.coerceDoc = doc
    return convert


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Dallal, a publish/subscribe message broker. With no options it "
        f"serves TCP clients on {DEFAULT_INTERFACE}:{DEFAULT_TCP_PORT}."
    )

    optParameters = [
        [
            "config",
            None,
            None,
            "Read options from this TOML file, one key per option (README.md, "
            "Configuration); the command line overrides it.  On SIGHUP the "
            "broker reads it again for the options that can change while it runs.",
        ],
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
            _number("udp", zero=True, maximum=MAX_PORT, doc="A port number, 0 for any free port."),
        ],
        [
            "http",
            None,
            None,
            "Serve Prometheus metrics (/metrics), a health check (/health) and "
            "a live dashboard (/) over HTTP on this port (on --interface) or "
            "server endpoint description (ssl:8443:privateKey=...), behind "
            "--passwords if given.",
        ],
        [
            "udp-ack-timeout",
            None,
            DEFAULT_UDP_ACK_TIMEOUT,
            "Seconds to wait for a UDP client's ack before sending a message "
            "again (UDP loses datagrams: resend sooner than over TCP, for as "
            "long).",
            _number("udp-ack-timeout", float),
        ],
        [
            "ping-interval",
            None,
            DEFAULT_INTERVAL,
            "Seconds between the server's pings to TCP clients, and between "
            "UDP clients' pings to it; a client that misses 3 in a row is "
            "dropped.",
            _number("ping-interval", float),
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
            _number("sys-interval", float, zero=True),
        ],
        [
            "shutdown-grace",
            None,
            DEFAULT_SHUTDOWN_GRACE,
            "Seconds a stopping broker waits for the messages in flight to be "
            "acked (it takes no new connections, publishes or subscriptions "
            "meanwhile); 0 closes every connection at once.",
            _number("shutdown-grace", float, zero=True),
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
            _number("max-connections"),
        ],
        [
            "max-connections-per-ip",
            None,
            _config.maxConnectionsPerIp,
            "TCP connections at once from one IP address (local clients all come from 127.0.0.1).",
            _number("max-connections-per-ip"),
        ],
        [
            "max-udp-clients",
            None,
            _config.maxUdpClients,
            "UDP client sessions at once; a HELLO for one more is answered ERR TOO_MANY_CLIENTS.",
            _number("max-udp-clients"),
        ],
        [
            "max-udp-clients-per-ip",
            None,
            _config.maxUdpClientsPerIp,
            "UDP client sessions at once whose client is at one IP address; a "
            "HELLO for one more from it is answered ERR TOO_MANY_CLIENTS.",
            _number("max-udp-clients-per-ip"),
        ],
        [
            "max-hellos-per-second",
            None,
            _config.maxHellosPerSecond,
            "UDP HELLOs per second from one IP address (as many at once after "
            "a quiet second); more are dropped unanswered.",
            _number("max-hellos-per-second"),
        ],
        [
            "max-subscriptions",
            None,
            _config.maxSubscriptions,
            "Subscriptions per client.",
            _number("max-subscriptions"),
        ],
        [
            "max-topic-length",
            None,
            _config.maxTopicLength,
            f"Longest topic or filter, in bytes (at most {MAX_TOPIC_LENGTH}: a UDP "
            "datagram has room for no longer).",
            _number("max-topic-length", maximum=MAX_TOPIC_LENGTH),
        ],
        [
            "max-topic-levels",
            None,
            _config.maxTopicLevels,
            "Most levels in a topic or filter (a/b/c has 3).",
            _number("max-topic-levels"),
        ],
        [
            "max-payload",
            None,
            _config.maxPayload,
            "Largest payload accepted, in bytes.",
            _number("max-payload"),
        ],
        [
            "max-line",
            None,
            _config.maxControlLine,
            "Longest control line, in bytes; a longer one is answered ERR "
            "LINE_TOO_LONG and closes the connection.",
            _number("max-line", minimum=MIN_CONTROL_LINE, maximum=MAX_CONTROL_LINE),
        ],
        [
            "max-output-bytes",
            None,
            _config.maxOutputBytes,
            "Bytes written to a TCP or MQTT client whose socket buffer is already full "
            "(answers it does not read); over it the connection is closed. The "
            "broker stops reading its requests meanwhile.",
            _number("max-output-bytes"),
        ],
        [
            "max-consecutive-errors",
            None,
            _config.maxConsecutiveErrors,
            "Requests refused in a row on one TCP connection or UDP session; the "
            "last is answered ERR - TOO_MANY_ERRORS and the connection closed (the "
            "session ended).",
            _number("max-consecutive-errors"),
        ],
        [
            "max-frame-seconds",
            None,
            _config.maxFrameSeconds,
            "Seconds a TCP client has to complete a frame (a control line, a "
            "payload) once it has sent part of it; then it is answered ERR - "
            "FRAME_TIMEOUT and closed.",
            _number("max-frame-seconds"),
        ],
        [
            "max-pending-logins",
            None,
            _config.maxPendingLogins,
            "Logins waiting for their password check at once (with --passwords); "
            "one more is answered ERR TOO_MANY_CLIENTS.",
            _number("max-pending-logins"),
        ],
        [
            "max-pending-logins-per-ip",
            None,
            _config.maxPendingLoginsPerIp,
            "Logins waiting for their password check at once from one IP address; "
            "addresses take turns, so a crowd from one delays another's login by "
            "a few checks at most.",
            _number("max-pending-logins-per-ip"),
        ],
        [
            "max-udp-answer-bytes",
            None,
            _config.maxUdpAnswerBytes,
            "Bytes a UDP session's remembered answers (which answer retried "
            "requests) may take, each counted with 256 of bookkeeping; the "
            "oldest are forgotten first.",
            _number("max-udp-answer-bytes"),
        ],
        [
            "max-udp-answer-bytes-total",
            None,
            _config.maxUdpAnswerBytesTotal,
            "Bytes the remembered answers of all UDP sessions may take.",
            _number("max-udp-answer-bytes-total"),
        ],
        [
            "max-matching-topics",
            None,
            _config.maxMatchingTopics,
            "Topics one publish to every matching topic (to-matching=1) may "
            "reach; a filter matching more is refused (ERR TOO_MANY_TOPICS).",
            _number("max-matching-topics"),
        ],
        [
            "max-listed",
            None,
            _config.maxListed,
            "Topics one TOPICS answer lists at most, whatever limit= it asks "
            "for; the answer says truncated.",
            _number("max-listed"),
        ],
        [
            "max-retained",
            None,
            _config.maxRetained,
            "Retained messages kept; a retained publish on one more topic is "
            "refused (ERR STORE_FAILED) and not published.",
            _number("max-retained"),
        ],
        [
            "max-retained-bytes",
            None,
            _config.maxRetainedBytes,
            "Payload bytes of all the retained messages kept, likewise.",
            _number("max-retained-bytes"),
        ],
        [
            "max-offline-sessions",
            None,
            DEFAULT_MAX_OFFLINE_SESSIONS,
            "MQTT sessions kept while their clients are away; one more ends with its connection.",
            _number("max-offline-sessions"),
        ],
        [
            "max-offline-bytes",
            None,
            DEFAULT_MAX_OFFLINE_BYTES,
            "Payload bytes all MQTT sessions whose clients are away hold together; "
            "a message for one over it is dropped.",
            _number("max-offline-bytes"),
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
            _number("max-inflight"),
        ],
        [
            "max-queued",
            None,
            _delivery.maxQueued,
            "Messages queued per client behind those in flight.",
            _number("max-queued"),
        ],
        [
            "max-queued-bytes",
            None,
            _delivery.maxQueuedBytes,
            "Payload bytes queued per client behind those in flight.",
            _number("max-queued-bytes"),
        ],
        [
            "slow-consumer",
            None,
            _delivery.slowConsumer,
            "What a full client queue costs once the client is a slow "
            "consumer (see --stall-timeout): drop-oldest drops its oldest "
            "queued message, disconnect drops the client.",
        ],
        [
            "stall-timeout",
            None,
            _delivery.stallTimeout,
            "Seconds a client with a full queue may make no progress (no ack, "
            "no drained socket) before it is a slow consumer; until then its "
            "publishers are slowed down, not its messages dropped.",
            _number("stall-timeout", float),
        ],
        [
            "ack-timeout",
            None,
            _delivery.ackTimeout,
            "Seconds to wait for an ack before sending a message again.",
            _number("ack-timeout", float),
        ],
        [
            "max-attempts",
            None,
            _delivery.maxAttempts,
            "Sends of one message to one client before it is dropped unacked.",
            _number("max-attempts"),
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
        [
            "bridge-users",
            None,
            None,
            "Users of the --passwords file that are other brokers' bridges, "
            "separated by commas: only they may send bridge frames (PUB with "
            "origin=, SUB with bridge=1).",
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
        self["mqtt"] = []
        self["bridge"] = []

    def parseOptions(self, options=None):
        """
        Parse the command line, and the configuration file that
        C{--config} names under it.  A wrong file stops twistd with one line
        naming the file and the key.
        """
        try:
            self.parseWithConfig(sys.argv[1:] if options is None else options)
        except ConfigError as error:
            raise SystemExit(f"dallal: cannot start: {error}") from error

    def parseWithConfig(self, argv):
        """
        Parse C{argv}, the command line of C{twistd dallal}, over the
        values of the configuration file it names, if any.

        @raise ConfigError: the file cannot be read, or a key or value of it
            is wrong.
        @raise usage.UsageError: the command line is wrong.
        """
        self.argv = list(argv)
        given, path = commandLineNames(self, self.argv)
        fromFile = set() if path is None else applyConfig(self, path, readConfig(path), given)
        try:
            usage.Options.parseOptions(self, self.argv)
        except usage.UsageError as error:
            # postOptions' checks of values that came from the file.
            for name in fromFile:
                if aboutOption(str(error), name):
                    raise ConfigError(inFile(path, name, str(error))) from error
            raise

    def opt_tcp(self, value):
        """
        Where to serve TCP clients: a port number (on --interface) or a Twisted endpoint description such as tcp:1373:interface=0.0.0.0 or ssl:8883:privateKey=key.pem:certKey=cert.pem. Repeat it to listen on several. [default: 1373]
        """
        self["tcp"].append(value)

    def opt_mqtt(self, value):
        """
        Also serve MQTT 3.1.1 and 5.0 clients here: a port number (on --interface) or a Twisted endpoint description such as tcp:1883:interface=0.0.0.0 or ssl:8883:privateKey=key.pem:certKey=cert.pem. Repeat it to listen on several. [default: none]
        """
        self["mqtt"].append(value)

    def opt_bridge(self, value):
        """
        Connect to another Dallal broker as a client and carry messages between them: NAME=ENDPOINT[,topics=FILTER;FILTER...][,direction=in|out|both][,user=USER,password-file=PATH|password-env=VARIABLE], such as hub=tcp:hub.example:1373,topics=news/#;alerts/+,direction=both (the default: every topic, both ways); user= logs in to a remote that takes passwords. Repeatable.
        """
        self["bridge"].append(value)

    def postOptions(self):
        self._checkLogFolder()
        if self["slow-consumer"] not in SLOW_CONSUMER_POLICIES:
            raise usage.UsageError(
                f"--slow-consumer must be one of {', '.join(SLOW_CONSUMER_POLICIES)}, "
                f"not {self['slow-consumer']!r}"
            )
        if not self["tcp"]:
            self["tcp"] = [str(DEFAULT_TCP_PORT)]
        self["tcp"] = [self._endpoint(value, "--tcp") for value in self["tcp"]]
        if self["http"] is not None:
            self["http"] = self._endpoint(self["http"], "--http")
        self["mqtt"] = [self._endpoint(value, "--mqtt") for value in self["mqtt"]]
        if self["name"] is not None:
            try:
                checkBrokerName(self["name"])
            except ValueError as error:
                raise usage.UsageError(f"--name: {error}") from error
        self["bridge"] = self._bridges(self["bridge"])
        self["bridge-users"] = self._bridgeUsers(self["bridge-users"])

    def _bridgeUsers(self, value):
        if value is None:
            return ()
        if self["passwords"] is None:
            raise usage.UsageError(
                "--bridge-users names users of the --passwords file: give it too"
            )
        names = tuple(name for name in value.split(",") if name)
        if not names:
            raise usage.UsageError("--bridge-users: no user name given")
        return names

    def _checkLogFolder(self):
        """
        Stop at once, with one line, when twistd's C{--logfile} is in a
        folder that does not exist: twistd would only find out after the
        data directory and the pid file are made, with a traceback.
        """
        logFile = _twistdOption(self, "logfile")
        if not logFile or logFile == "-":
            return
        folder = os.path.dirname(os.path.abspath(logFile))
        if not os.path.isdir(folder):
            raise SystemExit(
                f"dallal: cannot start: --logfile {logFile}: there is no folder {folder}"
            )

    def _bridges(self, values):
        # twistd has installed its reactor by now: the endpoints are checked
        # with the one they will use.
        from twisted.internet import reactor

        bridges = []
        for value in values:
            try:
                bridge = parseBridge(value, reactor)
            except ValueError as error:
                raise usage.UsageError(f"--bridge {error}") from error
            if bridge.name in {other.name for other in bridges}:
                raise usage.UsageError(f"--bridge {bridge.name}: two bridges have this name")
            bridges.append(bridge)
        return bridges

    def _endpoint(self, value, option):
        """
        The server endpoint description of a port number (on
        C{--interface}) or of a description, given to C{option}.
        """
        if value.isdigit():
            port = positiveNumber(
                value, zero=True, maximum=MAX_PORT, name=option, error=usage.UsageError
            )
            interface = self["interface"].replace(":", "\\:")
            return f"tcp:{port}:interface={interface}"
        if ":" not in value:
            raise usage.UsageError(
                f"{option}: {value!r} is neither a port number nor an endpoint "
                "description such as tcp:1373:interface=0.0.0.0"
            )
        return value


def _twistdOption(options, name):
    """
    The value of one of twistd's own options, or C{None} when C{options}
    was not parsed by twistd (tests, other programs).
    """
    parent = getattr(options, "parent", None)
    return None if parent is None else parent.get(name)


def _logsToTerminal(options):
    """
    Whether twistd writes its log where the operator started it: with
    C{-n} and no C{--logfile}, C{--syslog} or C{--logger}.
    """
    if not _twistdOption(options, "nodaemon"):
        return False
    return _twistdOption(options, "logfile") in (None, "-") and not (
        _twistdOption(options, "syslog") or _twistdOption(options, "logger")
    )


def reportStartFailures(reactor, terminal, publisher=globalLogPublisher):
    """
    Until the reactor runs, also write every error logged to C{terminal}
    (the standard error twistd is started with): a broker that cannot
    start says why where it was started, not only in its log file.
    """

    def write(event):
        terminal.write(formatEvent(event) + "\n")
        terminal.flush()

    observer = FilteringLogObserver(write, [LogLevelFilterPredicate(LogLevel.error)])
    publisher.addObserver(observer)
    reactor.callWhenRunning(publisher.removeObserver, observer)


def brokerConfig(options):
    """
    The broker's configuration from parsed L{Options}.
    """
    return BrokerConfig(
        maxConnections=options["max-connections"],
        maxConnectionsPerIp=options["max-connections-per-ip"],
        maxUdpClients=options["max-udp-clients"],
        maxUdpClientsPerIp=options["max-udp-clients-per-ip"],
        maxHellosPerSecond=options["max-hellos-per-second"],
        maxSubscriptions=options["max-subscriptions"],
        maxTopicLength=options["max-topic-length"],
        maxTopicLevels=options["max-topic-levels"],
        maxPayload=options["max-payload"],
        maxControlLine=options["max-line"],
        maxOutputBytes=options["max-output-bytes"],
        maxConsecutiveErrors=options["max-consecutive-errors"],
        maxFrameSeconds=options["max-frame-seconds"],
        maxPendingLogins=options["max-pending-logins"],
        maxPendingLoginsPerIp=options["max-pending-logins-per-ip"],
        maxUdpAnswerBytes=options["max-udp-answer-bytes"],
        maxUdpAnswerBytesTotal=options["max-udp-answer-bytes-total"],
        maxMatchingTopics=options["max-matching-topics"],
        maxListed=options["max-listed"],
        maxRetained=options["max-retained"],
        maxRetainedBytes=options["max-retained-bytes"],
        messageEvents=bool(options["message-events"]),
        name=options["name"],
        delivery=DeliveryConfig(
            maxInflight=options["max-inflight"],
            maxQueued=options["max-queued"],
            maxQueuedBytes=options["max-queued-bytes"],
            slowConsumer=options["slow-consumer"],
            ackTimeout=options["ack-timeout"],
            maxAttempts=options["max-attempts"],
            stallTimeout=options["stall-timeout"],
        ),
    )


def rereadConfig(options, service):
    """
    Parse the command line again over the configuration file as it is now
    (SIGHUP), and give the running service the options that changed and
    can change while it runs; log each change, and each change that needs
    a restart.  A file that cannot be read, or is wrong, changes nothing.

    @param options: the L{Options} the service was made with; those that
        change are changed in it too.
    """
    fresh = Options()
    try:
        fresh.parseWithConfig(options.argv)
    except (ConfigError, usage.UsageError) as error:
        service.fileReloaded("config", error)
        return
    events = service.broker.events
    for name in sorted(settingNames(options)):
        if fresh[name] == options[name]:
            continue
        if name in RELOADABLE_OPTIONS:
            options[name] = fresh[name]
            events.emit("option_changed", option=name, value=fresh[name])
        else:
            events.emit("restart_needed", LogLevel.warn, option=name)
    service.reconfigure(brokerConfig(options), options["shutdown-grace"])
    service.fileReloaded("config")


def makeService(options, reactor=None, rlimit=resource):
    """
    Build the broker service from parsed L{Options}.

    @param rlimit: the C{resource} module, whose descriptor limit is raised
        to make room for C{--max-connections} (tests give a fake one).
    """
    if reactor is None:
        from twisted.internet import reactor
    if getattr(options, "parent", None) is not None:
        # Run by twistd.  What the broker built to start (modules, classes,
        # its configuration) lives as long as it does: once the reactor
        # runs, the garbage collector stops walking it on every full
        # collection, which under a firehose was a tenth of the broker's
        # CPU (the messages and queues it walks are the traffic's).
        reactor.callWhenRunning(gc.freeze)
        if not _logsToTerminal(options):
            reportStartFailures(reactor, sys.stderr)
    config = brokerConfig(options)
    requested = config.maxConnections
    allowed, descriptors = fitToDescriptors(requested, rlimit)
    config = replace(config, maxConnections=allowed)
    try:
        gatekeeper = Gatekeeper.fromFiles(
            reactor,
            options["passwords"],
            options["acl"],
            options["bridge-users"],
            maxPendingChecks=config.maxPendingLogins,
            maxPendingChecksPerIp=config.maxPendingLoginsPerIp,
        )
        service = DallalService(
            reactor,
            config,
            pingInterval=options["ping-interval"],
            dataDir=options["data-dir"],
            sysInterval=options["sys-interval"],
            gatekeeper=gatekeeper,
            shutdownGrace=options["shutdown-grace"],
            reloadOnHangup=True,
            maxOfflineSessions=options["max-offline-sessions"],
            maxOfflineBytes=options["max-offline-bytes"],
        )
    except (StoreError, PasswordFileError, AclError, BrokerNameError) as error:
        # twistd would show a traceback; the operator needs the reason.
        raise SystemExit(f"dallal: cannot start: {error}") from error
    if allowed < requested:
        service.broker.events.emit(
            "limit_lowered",
            LogLevel.warn,
            limit=CONNECTIONS.name,
            max=allowed,
            requested=requested,
            descriptors=descriptors,
        )
    if options["config"] is not None:
        service.rereadConfig = lambda service: rereadConfig(options, service)
    for description in options["tcp"]:
        service.listenTCP(description)
    for description in options["mqtt"]:
        service.listenMQTT(description)
    if options["udp"] is not None:
        service.listenUDP(
            options["udp"], options["interface"], ackTimeout=options["udp-ack-timeout"]
        )
    if options["http"] is not None:
        service.listenHTTP(options["http"])
    for bridge in options["bridge"]:
        service.addBridge(bridge)
    return service
