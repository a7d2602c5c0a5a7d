"""Typed errors on the wire: VramdError <-> rpc.Error, both directions."""
from __future__ import annotations

from typing import Protocol

from ..errors import VramdError, error_from_wire
from ..pb import rpc_pb2 as rpc


def error_to_pb(exc: VramdError) -> rpc.Error:
    code = exc.code if exc.code in rpc.Code.keys() else "VRAMD_ERROR"  # noqa: SIM118 (an enum wrapper)
    err = rpc.Error(code=code, message=exc.message)
    if exc.bo_id is not None:
        err.bo_id = exc.bo_id
    if exc.offset is not None:
        err.offset = exc.offset
    return err


def code_name(code: int) -> str:
    """The name of a wire code; a code this side does not know (a newer peer's) keeps its number."""
    return enum_name(rpc.Code, code, "CODE_")


class _Enum(Protocol):
    """A protobuf enum wrapper (rpc.Code, rpc.SessionKind, ...): what enum_name needs of it."""

    def Name(self, number: int) -> str: ...


def enum_name(enum: _Enum, value: int, unknown: str) -> str:
    """The name of `value` in a protobuf enum; a value this side does not know (a newer peer's: a new session
    state or kind) is `unknown` followed by its number."""
    try:
        return str(enum.Name(value))
    except ValueError:
        return f"{unknown}{value}"


def error_from_pb(err: rpc.Error) -> VramdError:
    """The typed error for `err`; an unknown code gives a plain VramdError that keeps the code."""
    return error_from_wire(code_name(err.code), err.message,
                           err.bo_id if err.HasField("bo_id") else None,
                           err.offset if err.HasField("offset") else None)


def raise_for_error(resp: rpc.Response) -> rpc.Response:
    """`resp`, or its typed error raised."""
    if resp.error.code != rpc.OK:
        raise error_from_pb(resp.error)
    return resp
