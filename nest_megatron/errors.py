"""The one error type a user sees: a single line naming what is wrong and what is allowed."""


class NestError(ValueError):
    """Bad user input (a config value, an override, a configuration that cannot run).

    The message is one line, written for the person who typed the input; the CLI prints it and
    exits non-zero without a traceback.
    """


class InfeasibleError(NestError):
    """A configuration that is valid for Megatron but does not fit in device memory."""
