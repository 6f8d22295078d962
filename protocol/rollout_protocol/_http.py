"""The control plane's HTTP surface below its routes: strict request bodies and their size limit,
replies, the error bodies of both dialects, and the OpenAPI document's declared errors.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._routes import (
    GYM_PREFIX,
    error_responses,
)
from ._wire import (
    API_PREFIX,
    ErrorBody,
    ErrorCode,
    ProtocolError,
)

_Model = TypeVar("_Model", bound=BaseModel)


async def parse_body(request: Request, model: type[_Model]) -> _Model:
    """Parse the body strictly (no coercion of strings into numbers) with errors naming fields."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, describe_validation(error)) from None


def describe_validation(error: ValidationError | RequestValidationError) -> str:
    """`field: message` for each problem (at most five), so a client sees what to fix."""
    parts: list[str] = []
    for problem in error.errors()[:5]:
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        parts.append(f"{'.'.join(location) or 'body'}: {problem.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def request_body_schema(model: type[BaseModel] | None) -> dict[str, Any] | None:
    """The OpenAPI request body of a route (its endpoint reads the body itself, strictly)."""
    if model is None:
        return None
    schema = _inline_refs(model.model_json_schema())
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its `$defs` substituted, so it stands alone in OpenAPI."""
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(definitions[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


def json_reply(model: BaseModel, *, unread: frozenset[str] = frozenset()) -> Response:
    """`model` as a JSON reply, without the fields in `unread` (those the caller would refuse:
    `_wire.fields_unread_by`)."""
    return Response(
        content=model.model_dump_json(exclude=set(unread) or None), media_type="application/json"
    )


def gym_error_response(error: ProtocolError) -> Response:
    """A refusal in Gym's form (`_gym.gym_error`: Gym's codes and statuses, docs/protocol.md)."""
    from . import _gym as gym

    status, body = gym.gym_error(error.code, error.detail)
    headers = {"WWW-Authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHORIZED else None
    return Response(
        content=json.dumps(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(path: str, error: ProtocolError) -> Response:
    """A refusal in the error body of the dialect whose route `path` is: Gym's under
    `GYM_PREFIX` (`gym_error_response`), ours everywhere else (docs/protocol.md, "The NeMo Gym
    dialect").

    The one place that decides, by path, for refusals made outside a route's endpoint: the body
    limit (before routing, or while FastAPI reads a body) and the app's exception handlers.
    """
    if path == GYM_PREFIX or path.startswith(f"{GYM_PREFIX}/"):
        return gym_error_response(error)
    headers = {"WWW-Authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHORIZED else None
    return Response(
        content=error.body().model_dump_json(),
        status_code=error.status_code,
        media_type="application/json",
        headers=headers,
    )


async def protocol_error_handler(request: Request, error: Exception) -> Response:
    if isinstance(error, BodyTooLarge):
        error = ProtocolError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"{error.detail} (ROLLOUT_MAX_BODY_BYTES)",
        )
    assert isinstance(error, ProtocolError)
    return error_response(request.scope["path"], error)


async def validation_error_handler(request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    return await protocol_error_handler(
        request, ProtocolError(ErrorCode.INVALID_REQUEST, describe_validation(error))
    )


async def http_error_handler(request: Request, error: Exception) -> Response:
    """Starlette's own refusals: a body it cannot decode (400) is the protocol's
    `invalid_request`, with its error body; the rest (404, 405, ...) stay as they are."""
    assert isinstance(error, HTTPException)
    if error.status_code == 400:
        return await protocol_error_handler(
            request, ProtocolError(ErrorCode.INVALID_REQUEST, f"body: {error.detail}")
        )
    return await http_exception_handler(request, error)


# --- request bodies and the published document ----------------------------------------------


class BodyTooLarge(HTTPException):
    """Raised while a body is read past the limit; answered as `payload_too_large` (413).

    An `HTTPException` so that FastAPI's own body parsing lets it through unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")
        self.limit = limit


class BodyLimit:
    """ASGI middleware: no request body larger than `max_bytes` is read, on any route.

    A declared `Content-Length` over the limit is refused before the app runs, without reading
    a byte; a body sent without one (chunked) is counted as it is read and refused once it
    passes the limit, so at most `max_bytes` plus one chunk is ever held.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                error = ProtocolError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"Content-Length {int(value)} is over the limit of {limit} bytes "
                    "(ROLLOUT_MAX_BODY_BYTES)",
                )
                await _send_error(scope, receive, send, error)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


async def _send_error(scope: Scope, receive: Receive, send: Send, error: ProtocolError) -> None:
    """Answer `error` before the app runs, in the error body of the route's dialect
    (`error_response`), and close the connection: the unread body is not drained."""
    response = error_response(scope["path"], error)
    response.headers["connection"] = "close"
    await response(scope, receive, send)


SERVER_ROUTE_ERRORS = frozenset(ErrorCode)
"""What a participant's own POST route may answer: its own refusals, and any refusal of a peer
it calls on the caller's behalf, relayed with the peer's code (`unreachable` for a peer gone)."""


def declare_error_statuses(app: FastAPI) -> None:
    """Declare in the app's OpenAPI document the error statuses of its own routes.

    Every route may answer `payload_too_large` (the body limit) and `internal`; routes with a
    body or parameters `invalid_request` (422, with the protocol's error body rather than
    FastAPI's validation body); POST routes every status of `SERVER_ROUTE_ERRORS`. Statuses a
    route declares itself are kept. The control routes declare theirs from `ROUTES`.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        _declare_errors(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _declare_errors(document: dict[str, Any]) -> None:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    if "ErrorBody" not in components:
        schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components["ErrorBody"] = schema
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in document.get("paths", {}).items():
        if path.startswith((API_PREFIX, GYM_PREFIX)):
            continue
        for method, operation in operations.items():
            codes = {ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.INTERNAL}
            if operation.get("requestBody") or operation.get("parameters"):
                codes.add(ErrorCode.INVALID_REQUEST)
            if method == "post":
                codes |= SERVER_ROUTE_ERRORS
            responses = operation.setdefault("responses", {})
            validation = responses.get("422", {})
            if "HTTPValidationError" in json.dumps(validation):
                del responses["422"]  # answered with the protocol's error body instead
            for status, entry in error_responses(codes).items():
                responses.setdefault(
                    str(status), {"description": entry["description"], "content": error_body}
                )
