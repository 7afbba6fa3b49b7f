"""
The seam between the broker core and its transports.

The core (L{dallal.core.Broker}) decides who gets what; a transport turns
its decisions into bytes.  A connection (TCP) or a remembered address (UDP)
provides L{ISubscriber}; the core never sees a socket.
"""

from zope.interface import Attribute, Interface


class ISubscriber(Interface):
    """
    A client session as the broker core sees it.
    """

    peer = Attribute("The client's address as 'host:port', for the log.")
    transportName = Attribute("'tcp' or 'udp', for the log and statistics.")

    def sendMessage(message):
        """
        Send a L{dallal.core.Message} to this client.

        Only called while the subscriber is attached to the broker.
        """
