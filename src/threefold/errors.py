"""The one exception type that means "the user asked for something wrong".

The CLI turns it into a single line on stderr and exit code 2; every other exception is a
bug or an environment failure and exits 1 with its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input (config, layout, paths), with the fix in the message."""

    def line(self) -> str:
        """The one line the CLI prints for it."""
        return f"threefold: error: {self}"


class ConfigError(UserError):
    """A config value is unknown, mistyped or inconsistent; `field` names the offending key."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)
