"""ConfigError: a mistake the user can fix, with a message that says how.

main.py turns it into a one-line `error: ...`. It sits in a module of its own, below
everything, because modules that utils.py reaches (metrics.py, through the plots of
`python utils.py plot`) raise it too; utils.py re-exports it.
"""


class ConfigError(ValueError):
    """A config the user can fix; the message says how."""
