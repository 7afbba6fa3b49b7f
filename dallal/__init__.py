"""
Dallal ("broker" in Persian): a publish/subscribe message broker on Twisted.
"""

__version__ = "0.1.0"
