"""Wire protocols: codecs and framing without I/O, shared by the client and the server."""
