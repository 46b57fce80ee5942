"""The exceptions dte raises: one class per canonical code, all DteError.

The codes are Abseil's canonical ones (docs/errors.md). Every failure of
libdte's C ABI (sync/capi/c_api.h) comes back as a dte_code; error() is the
one place that turns a code into its class. Each class also extends the
builtin exception that fits it, so code that knows nothing of dte can catch
it: a NotFound is a FileNotFoundError, a DeadlineExceeded a TimeoutError, an
Unavailable a ConnectionError. A few calls refine a code for their case (a
push receiver's wait_for: "failed precondition" is missed pushes); they pass
that refinement to error(), which checks it is a subclass of the code's class.

    try:
        rx.wait_for(version)
    except dte.MissedPushes:
        rx.catch_up(store)
    except dte.DteError as e:
        if not e.transient:
            raise

.code stays the C ABI's integer for logs and for code that must forward it;
catch by class. .transient says whether retrying unchanged can succeed.
"""

import warnings
from typing import Any, Dict, FrozenSet, Mapping, Optional, Type

OK = 0
INVALID_ARGUMENT = 1
NOT_FOUND = 2
ALREADY_EXISTS = 3
CORRUPTION = 4
IO_ERROR = 5
# 6 was BUSY, retired in C API 10 (now UNAVAILABLE); the number stays unused.
UNIMPLEMENTED = 7
INTERNAL = 8
PERMISSION_DENIED = 9
FAILED_PRECONDITION = 10
ABORTED = 11
DEADLINE_EXCEEDED = 12
UNAVAILABLE = 13

CODE_NAMES: Dict[int, str] = {
    INVALID_ARGUMENT: "invalid argument", NOT_FOUND: "not found", ALREADY_EXISTS: "already exists",
    CORRUPTION: "corruption", IO_ERROR: "I/O error", UNIMPLEMENTED: "unimplemented",
    INTERNAL: "internal", PERMISSION_DENIED: "permission denied",
    FAILED_PRECONDITION: "failed precondition", ABORTED: "aborted",
    DEADLINE_EXCEEDED: "deadline exceeded", UNAVAILABLE: "unavailable"}

# The codes worth retrying unchanged after a wait (dte_code_transient).
TRANSIENT_CODES: FrozenSet[int] = frozenset({UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED})


def is_transient(code: int) -> bool:
    """Whether a failure with dte_code `code` is worth retrying unchanged."""
    return int(code) in TRANSIENT_CODES


class DteError(RuntimeError):
    """A failed dte call. .code is the C ABI's dte_code (sync/capi/c_api.h); the
    subclass says the kind, and the message names what was involved."""

    code: int = INTERNAL

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.code = type(self).code if code is None else int(code)

    def __str__(self) -> str:
        # OSError subclasses would otherwise print their (errno, strerror).
        return str(self.args[0]) if self.args else ""

    @property
    def transient(self) -> bool:
        """True when retrying the same call later can succeed (Unavailable,
        DeadlineExceeded, Aborted)."""
        return is_transient(self.code)


class InvalidArgument(DteError, ValueError):
    """A bad argument, checkpoint, layout or configuration: fix the call."""
    code = INVALID_ARGUMENT


class NotFound(DteError, FileNotFoundError, LookupError):
    """A version, tensor, store, file or mount that is not there."""
    code = NOT_FOUND


class AlreadyExists(DteError, FileExistsError):
    """What a call would create is there already (a name, an object)."""
    code = ALREADY_EXISTS


class VersionConflict(AlreadyExists):
    """Another writer got there first: the version (or the store's latest
    version this writer expected) was committed by someone else. What the C
    ABI's "already exists" means: its writers create nothing else."""


class Corrupt(DteError):
    """Data loss: stored bytes do not match their hash or their format's
    grammar. Retrying does not help; the store or the file must be repaired."""
    code = CORRUPTION


class IOFailure(DteError, OSError):
    """The operating system, the network or a remote store failed, in a way
    that retrying unchanged is not expected to fix."""
    code = IO_ERROR


class FailedPrecondition(DteError):
    """The state is wrong for the call (a receiver behind the trainer, a
    mount with no live version yet): change the state first, then call again."""
    code = FAILED_PRECONDITION


class MissedPushes(FailedPrecondition):
    """A push receiver missed versions the trainer pushed: catch up from the
    store (PushReceiver.catch_up), then wait again."""


class Aborted(DteError):
    """A concurrency conflict abandoned the call (a peer aborted the round,
    a newer request superseded it): retry the whole operation."""
    code = ABORTED


class DeadlineExceeded(DteError, TimeoutError):
    """A wait ran out of time (a receiver, a push group, a transport, a
    store request)."""
    code = DEADLINE_EXCEEDED


class Unavailable(DteError, ConnectionError):
    """A peer, the store or a lock is unreachable for now (a cache index in
    use by another process, a running live apply, an overloaded S3
    endpoint): retry later."""
    code = UNAVAILABLE


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
    c.code: c for c in (InvalidArgument, NotFound, VersionConflict, Corrupt, IOFailure,
                        Unimplemented, InternalError, PermissionDenied, FailedPrecondition,
                        Aborted, DeadlineExceeded, Unavailable)}

# Names retired in C API 10, kept for one release: module __getattr__ warns.
DEPRECATED: Dict[str, Any] = {"Timeout": DeadlineExceeded, "Busy": Unavailable}


def deprecated(module: str, name: str) -> Any:
    """The replacement of retired name `name` of `module`, with a
    DeprecationWarning; AttributeError for any other name."""
    if name not in DEPRECATED:
        raise AttributeError("module %r has no attribute %r" % (module, name))
    new = DEPRECATED[name]
    warnings.warn("%s.%s is deprecated: use %s.%s" % (module, name, module, new.__name__),
                  DeprecationWarning, stacklevel=3)
    return new


def __getattr__(name: str) -> Any:
    return deprecated(__name__, name)


def error(code: int, message: str,
          refine: Optional[Mapping[int, Type[DteError]]] = None) -> DteError:
    """The exception for dte_code `code`: its class, or the call's
    refinement of it (e.g. {FAILED_PRECONDITION: MissedPushes}). An unknown
    code is an InternalError that keeps the code."""
    cls = _BY_CODE.get(code, InternalError)
    if refine and code in refine:
        if not issubclass(refine[code], cls):
            raise TypeError("%s does not refine %s" % (refine[code].__name__, cls.__name__))
        cls = refine[code]
    return cls(message, code)
