"""The one error type users see: a single line naming the bad value."""


class SpecpilotError(Exception):
    """Bad input or an unusable resource.

    The CLI prints ``specpilot: error: <message>`` and exits with status 2; no traceback.
    Raise it with a message that names the offending value (path, key, number).
    """
