"""Errors that are the user's to fix: the CLI prints their message alone, without a traceback."""


class AsyncRLError(Exception):
    """A problem with a clear cause and fix (bad config, missing model, dead peer, port in use)."""
