"""Scenarios `auth.every-route` and `bodies.strict`: every route of the target's dialect
refuses a call without the token or with a wrong one, and a body with an unknown field, a
wrong type or a missing id, each with the protocol's error reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from .. import _gym as gym
from .._routes import CONTROL_ROUTES, GYM_CAPABILITIES_PATH, Dialect, Route
from .._wire import (
    ErrorCode,
)
from .calls import Target, _Conn, _connect, _expect, _new_id
from .report import AUTH, BODIES, _describe, _error_body

_PAST_DEADLINE = 1.0


"""A valid `deadline_ts` that has passed: a body that gets through is refused without effect."""


_EXAMPLE_VALUES: Mapping[str, Any] = {
    "deadline_ts": _PAST_DEADLINE,
    "attempt": 0,
    "rollout_ids": ["kit-rollout"],
    "episode_ids": [{"rollout_id": "kit-rollout", "attempt": 0}],
}


_ID_FIELDS = ("checkpoint_id", "operation_id")


_GYM_ID_FIELDS = ("checkpoint_dir",)


"""Gym fields that name the checkpoint (the directory, relative to the set)."""


_UNKNOWN_FIELD = "kit_unknown_field"


def _request_model(route: Route[Any, Any], dialect: Dialect) -> type[BaseModel] | None:
    """The request body model of `route` in `dialect`."""
    return route.request if dialect is Dialect.ROLLOUT else gym.codec(route).request


def _dialect_routes(dialect: Dialect) -> list[Route[Any, Any]]:
    """The routes of the table that `dialect` has."""
    return [route for route in CONTROL_ROUTES if route.path_in(dialect) is not None]


def _example_body(
    route: Route[Any, Any], ident: str, dialect: Dialect = Dialect.ROLLOUT
) -> dict[str, Any]:
    """A well-formed request body for `route` (in `dialect`) whose deadline has passed."""
    model = _request_model(route, dialect)
    assert model is not None
    body: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if name in _GYM_ID_FIELDS or name in _ID_FIELDS:
            body[name] = ident
        elif name == "checkpoint_ids":
            body[name] = [ident]
        elif name in _EXAMPLE_VALUES:
            body[name] = _EXAMPLE_VALUES[name]
        elif info.is_required():
            raise RuntimeError(f"the kit has no example value for {model.__name__}.{name}")
    model.model_validate(body, strict=True)
    return body


def _refusal(response: httpx.Response, dialect: Dialect) -> tuple[str, str] | None:
    """The error code (as the dialect names it) and detail of a refusal; None without a body."""
    if dialect is Dialect.ROLLOUT:
        body = _error_body(response)
        return None if body is None else (body.error.code.value, body.error.detail)
    try:
        gym_body = gym.GymErrorBody.model_validate_json(response.content)
    except ValidationError:
        try:  # FastAPI's 422, Gym's answer to a body its models refuse
            validation = gym.GymValidationBody.model_validate_json(response.content)
        except ValidationError:
            return None
        return ErrorCode.INVALID_REQUEST.value, "; ".join(item.msg for item in validation.detail)
    return gym_body.error.code, gym_body.error.detail


async def _expect_refusal(
    conn: _Conn,
    rule: str,
    route: Route[Any, Any],
    what: str,
    *,
    headers: Mapping[str, str],
    content: bytes | None,
    status: int,
    code: ErrorCode,
    naming: str | None = None,
) -> None:
    """Send a raw request through `route` (in the target's dialect); it must be refused with
    `status` and `code` (as the dialect says them: `_gym.gym_error` for Gym's)."""
    dialect = conn.target.dialect
    path = route.path_in(dialect)
    assert path is not None
    if dialect is Dialect.GYM:
        status, gym_body = gym.gym_error(code, "")
        name = gym_body["error"]["code"] if "error" in gym_body else ErrorCode.INVALID_REQUEST.value
    else:
        name = code.value
    if content is not None:
        headers = {**headers, "Content-Type": "application/json"}
    response = await conn.http.request(
        route.method,
        conn.url(path),
        headers=headers,
        content=content,
        timeout=conn.call_timeout_s,
    )
    error = _refusal(response, dialect)
    named = "" if naming is None else f" naming {naming!r}"
    _expect(
        rule,
        response.status_code == status
        and error is not None
        and error[0] == name
        and (naming is None or naming in error[1]),
        f"{route.method} {path} {what} must answer {status} {name}{named}",
        _describe(response),
    )


async def check_auth(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`auth.every-route`: every route a plane mounts (`CONTROL_ROUTES`) refuses a missing or wrong
    token with 401.

    Without a token the body is not even JSON, with a wrong token it is well-formed (with a
    passed deadline, so a route that lets it through does nothing): both must be 401 with code
    `unauthorized`, proving the token is checked before the body is read or validated.
    """
    async with _connect([target], call_timeout_s) as (conn,):
        await conn.status(AUTH)  # the right token works: the base URL and token are right
        wrong = {"Authorization": f"Bearer wrong-{target.token}"}
        dialect = target.dialect
        for route in _dialect_routes(dialect):
            has_body = _request_model(route, dialect) is not None
            well_formed = (
                json.dumps(_example_body(route, _new_id("auth"), dialect)).encode()
                if has_body
                else None
            )
            for what, headers, content in (
                (
                    "without a token (before reading its body)",
                    {},
                    b"{not json" if has_body else None,
                ),
                ("with a wrong token", wrong, well_formed),
            ):
                await _expect_refusal(
                    conn,
                    AUTH,
                    route,
                    what,
                    headers=headers,
                    content=content,
                    status=401,
                    code=ErrorCode.UNAUTHORIZED,
                )
        if dialect is Dialect.GYM:
            # Gym's capabilities say what the participant takes part in: behind the token too
            url = conn.url(GYM_CAPABILITIES_PATH)
            for what, headers in (("without a token", {}), ("with a wrong token", wrong)):
                response = await conn.http.get(url, headers=headers, timeout=call_timeout_s)
                refusal = _refusal(response, dialect)
                _expect(
                    AUTH,
                    response.status_code == 401
                    and refusal is not None
                    and refusal[0] == ErrorCode.UNAUTHORIZED.value,
                    f"GET {GYM_CAPABILITIES_PATH} {what} must answer 401 unauthorized",
                    _describe(response),
                )


async def check_strict_bodies(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`bodies.strict`: every route with a body refuses an unknown field, a wrong type and a
    string for a number with 422 `invalid_request`, naming the field."""
    async with _connect([target], call_timeout_s) as (conn,):
        headers = {"Authorization": f"Bearer {target.token}"}
        dialect = target.dialect
        for route in _dialect_routes(dialect):
            if _request_model(route, dialect) is None:
                continue
            body = _example_body(route, _new_id("body"), dialect)
            id_field = next(name for name in (*_ID_FIELDS, "checkpoint_ids") if name in body)
            cases = [
                ("an unknown field", _UNKNOWN_FIELD, {**body, _UNKNOWN_FIELD: 1}),
                ("a number for a string", id_field, {**body, id_field: 12345}),
                ("a string for a number", "deadline_ts", {**body, "deadline_ts": "1.0"}),
            ]
            for what, name, bad in cases:
                await _expect_refusal(
                    conn,
                    BODIES,
                    route,
                    f"with {what} ({name})",
                    headers=headers,
                    content=json.dumps(bad).encode(),
                    status=422,
                    code=ErrorCode.INVALID_REQUEST,
                    naming=name,
                )
