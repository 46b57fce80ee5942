"""The exceptions dte raises: one class per kind of failure, all DteError.

Every failure of libdte's C ABI (sync/capi/c_api.h) comes back as a dte_code;
error() is the one place that turns a code into its class. A few calls
document what a code means for them (a push receiver's wait_for: "not found"
is missed pushes, "I/O error" a timeout); they pass that refinement to
error(), which still checks it is a subclass of the code's class.

    try:
        rx.wait_for(version)
    except dte.MissedPushes:
        rx.catch_up(store)

.code stays the C ABI's integer for logs and for code that must forward it;
catch by class.
"""

from typing import Dict, Mapping, Optional, Type

OK = 0
INVALID_ARGUMENT = 1
NOT_FOUND = 2
ALREADY_EXISTS = 3
CORRUPTION = 4
IO_ERROR = 5
BUSY = 6
UNIMPLEMENTED = 7
INTERNAL = 8
PERMISSION_DENIED = 9

CODE_NAMES: Dict[int, str] = {
    INVALID_ARGUMENT: "invalid argument", NOT_FOUND: "not found", ALREADY_EXISTS: "already exists",
    CORRUPTION: "corruption", IO_ERROR: "I/O error", BUSY: "busy",
    UNIMPLEMENTED: "unimplemented", INTERNAL: "internal", PERMISSION_DENIED: "permission denied"}


class DteError(RuntimeError):
    """A failed dte call. .code is the C ABI's dte_code (sync/capi/c_api.h); the
    subclass says the kind, and the message names what was involved."""

    code: int = INTERNAL

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.code = type(self).code if code is None else int(code)


class InvalidArgument(DteError, ValueError):
    """A bad argument, checkpoint, layout or configuration: fix the call."""
    code = INVALID_ARGUMENT


class NotFound(DteError, LookupError):
    """A version, tensor, store, file or mount that is not there."""
    code = NOT_FOUND


class MissedPushes(NotFound):
    """A push receiver missed versions the trainer pushed: catch up from the
    store (PushReceiver.catch_up), then wait again."""


class AlreadyExists(DteError):
    """What a call would create is there already (a name, an object)."""
    code = ALREADY_EXISTS


class VersionConflict(AlreadyExists):
    """Another writer got there first: the version (or the store's latest
    version this writer expected) was committed by someone else. What the C
    ABI's "already exists" means: its writers create nothing else."""


class Corrupt(DteError):
    """Stored bytes do not match their hash or their format's grammar."""
    code = CORRUPTION


class IOFailure(DteError):
    """The operating system, the network or a remote store failed."""
    code = IO_ERROR


class Timeout(IOFailure, TimeoutError):
    """A wait ran out of time (a receiver, a push group, a transport)."""


class Busy(DteError):
    """Another process holds what this call needs (a lock, a running apply)."""
    code = BUSY


class Unimplemented(DteError, NotImplementedError):
    """Something this build or this version of dte does not do."""
    code = UNIMPLEMENTED


class InternalError(DteError):
    """A bug in dte: please report it with the message."""
    code = INTERNAL


class PermissionDenied(DteError, PermissionError):
    """The store, the daemon or a peer refused: credentials, modes, the job
    secret."""
    code = PERMISSION_DENIED


_BY_CODE: Dict[int, Type[DteError]] = {
    c.code: c for c in (InvalidArgument, NotFound, VersionConflict, Corrupt, IOFailure, Busy,
                        Unimplemented, InternalError, PermissionDenied)}


def error(code: int, message: str,
          refine: Optional[Mapping[int, Type[DteError]]] = None) -> DteError:
    """The exception for dte_code `code`: its class, or the call's
    refinement of it (e.g. {NOT_FOUND: MissedPushes}). An unknown code is an
    InternalError that keeps the code."""
    cls = _BY_CODE.get(code, InternalError)
    if refine and code in refine:
        if not issubclass(refine[code], cls):
            raise TypeError("%s does not refine %s" % (refine[code].__name__, cls.__name__))
        cls = refine[code]
    return cls(message, code)
