"""Exceptions for bad user input. The CLI prints them as one line (no traceback) and exits with status 2."""


class UserError(ValueError):
    """Bad input a user can fix: the message names the file/row/field or the config key, the value and the fix."""


class DataError(UserError):
    """A dataset file, row or field is unusable."""


class ConfigError(UserError):
    """A configuration value is out of range or inconsistent with another."""


class TrainingError(UserError):
    """Training cannot go on (e.g. too many optimizer steps in a row with a non-finite gradient)."""
