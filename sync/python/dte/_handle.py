"""What every class over a libdte handle shares: raising a failed call's
exception, owning the handle, the job secret argument and the optional
torch import."""

from __future__ import annotations

import ctypes
from types import ModuleType, TracebackType
from typing import Mapping, Optional, Type, TypeVar

from dte._errors import CODE_NAMES, DteError, InvalidArgument, error
from dte._lib import lib

_H = TypeVar("_H", bound="_Handle")


def _check(rc: int, refine: Optional[Mapping[int, Type[DteError]]] = None) -> None:
    """Raises the exception of a failed C ABI call (rc, dte_last_error()):
    its code's class, or the call's documented refinement of it."""
    if rc != 0:
        msg = lib.dte_last_error().decode("utf-8", "replace")
        raise error(rc, "%s: %s" % (CODE_NAMES.get(rc, "error %d" % rc), msg), refine)


def _text(out: ctypes.c_char_p) -> str:
    """The C string a call stored to a const char** out parameter."""
    return (out.value or b"").decode("utf-8", "replace")


def _secret_arg(secret: str | bytes | None) -> Optional[bytes]:
    """secret= as the C ABI takes it: None (from the environment) or bytes."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret or b"\0" in secret:
        raise InvalidArgument("secret must be a non-empty str or bytes without NUL bytes")
    return secret


def _torch() -> Optional[ModuleType]:
    """The torch module when it can be imported, else None."""
    try:
        import torch
        return torch
    except ImportError:
        return None


class _Handle:
    """Owns one C handle, closed exactly once: by close(), at the end of a
    with block, or when the object is collected. Subclasses name the C
    function that closes it."""

    _h: Optional[ctypes.c_void_p] = None
    _close_fn: str = ""  # name of the dte_*_close function

    def close(self) -> None:
        if self._h:
            h, self._h = self._h, None
            _check(getattr(lib, self._close_fn)(h))

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except DteError:
            pass  # nothing to tell at collection; the handle is gone either way
