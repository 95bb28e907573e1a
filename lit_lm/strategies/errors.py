"""The one error type for input a user can fix (a configuration value, a data file, a checkpoint)."""


class ConfigError(ValueError):
    """A bad configuration value or input: the message says what, names the key and the fix. lit-lm's CLI prints
    it as one line, `lit-lm: error: <message>`, without a traceback."""
