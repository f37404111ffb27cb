"""Moved to llamarl_core.control.auth (the control plane's package); its names
import from here, with a DeprecationWarning, for one more release."""

from ._moved import moved_names

__getattr__ = moved_names(__name__, {
    name: ("llamarl_core.control.auth", name)
    for name in ("SECRET_ENV", "SECRET_FILE_ENV", "SECRET_BYTES", "MIN_SECRET_BYTES", "TAG_BYTES", "AuthenticatedStore",
                 "new_secret", "parse_secret", "read_secret_file", "write_secret_file", "secret_from_env",
                 "required_secret", "refused_count", "derive", "sign", "verify")
})
