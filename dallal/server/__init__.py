"""Servers: the network protocols that connect clients to the broker, the twistd service and its options."""
