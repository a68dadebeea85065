"""The caller's half of idemgate: keys, and (to come) the reservation API."""

from .keys import DERIVE_KEY_TAG, derive_key

__all__ = ["DERIVE_KEY_TAG", "derive_key"]
