"""The broker: who is subscribed to what, who gets each message, and what it cost. No sockets, no frames."""
