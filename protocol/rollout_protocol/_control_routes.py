"""A control plane's HTTP endpoints: one per route of `_routes.CONTROL_ROUTES` in each mounted
dialect (ours under `/checkpoint/v1`, NeMo Gym's under `/ng-control/v1`, mapped by `_gym`), plus
Gym's capabilities, each checking the control token before it parses a body.

The route table in `_routes.py` stays the one declaration that both the client and this server
are built from; this module only turns it into endpoints that call the plane's operations (by
route name, `ControlPlane._handlers`). Held apart from `ControlPlane` (`_control.py`) because
it is the plane's HTTP surface, not its state: it reads the plane only through `PlaneView`.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from . import tracing
from ._http import gym_error_response, json_reply, parse_body, request_body_schema
from ._routes import CONTROL_ROUTES, GYM_CAPABILITIES_PATH, ROUTES, Dialect, Route
from ._settings import ControlSettings
from ._wire import CAPABILITIES_HEADER, ErrorCode, ProtocolError, fields_unread_by

if TYPE_CHECKING:
    from . import _gym as gym

Handler = Callable[[Any], Awaitable[BaseModel]]
"""A plane's operation behind a route: its request body (None for `status`) to its reply."""


class PlaneView(Protocol):
    """What the endpoints read of their plane, each time they answer."""

    @property
    def settings(self) -> ControlSettings: ...

    @property
    def attempt(self) -> int: ...

    @property
    def checkpoint_id(self) -> str | None: ...


def authorize(settings: ControlSettings, header: str | None) -> None:
    """Check an `Authorization` header against the control token in constant time."""
    expected = settings.token
    if expected is None:
        return
    if header is None:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing Authorization: Bearer <token>")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode(), expected.encode()
    ):
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "wrong control token")


class ControlRouter:
    """Builds the plane's `APIRouter` from the route table (`build`)."""

    def __init__(
        self, plane: PlaneView, handlers: Mapping[str, Handler], clock: Callable[[], float]
    ) -> None:
        self._plane = plane
        self._handlers = handlers
        self._clock = clock

    def build(self) -> APIRouter:
        """One endpoint per route of the table and mounted dialect; bodies are parsed strictly
        after the token. Both dialects call the same handlers."""
        router = APIRouter()
        dialects = self._plane.settings.dialects
        if Dialect.GYM in dialects:
            # Imported only where Gym's dialect is mounted: its models cost every other server
            # start (docs/operations.md, "What a server start costs").
            from . import _gym as gym
        for dialect in dialects:
            for route in CONTROL_ROUTES:
                path = route.path_in(dialect)
                if path is None:
                    continue
                handler = self._handlers[route.name]
                if dialect is Dialect.ROLLOUT:
                    endpoint = self._endpoint(route, handler)
                    reply_model: type[BaseModel] = route.reply
                    responses = route.error_statuses()
                    body_schema = request_body_schema(route.request)
                else:
                    codec = gym.codec(route)
                    endpoint = self._gym_endpoint(codec, handler)
                    reply_model = codec.reply
                    responses = gym.error_responses(route.errors)
                    body_schema = request_body_schema(codec.request)
                router.add_api_route(
                    path,
                    endpoint,
                    methods=[route.method],
                    response_model=reply_model,
                    responses=responses,
                    summary=route.summary,
                    name=route.name if dialect is Dialect.ROLLOUT else f"gym-{route.name}",
                    openapi_extra=body_schema,
                )
        if Dialect.GYM in dialects:
            router.add_api_route(
                GYM_CAPABILITIES_PATH,
                self._capabilities_endpoint(),
                methods=["GET"],
                response_model=gym.GymCapabilities,
                summary="What this participant takes part in, and in which dialects.",
                name="gym-capabilities",
            )
        return router

    def _endpoint(
        self, route: Route[Any, Any], handler: Handler
    ) -> Callable[[Request], Awaitable[Response]]:
        plane = self._plane

        async def endpoint(request: Request) -> Response:
            authorize(plane.settings, request.headers.get("authorization"))
            body = None if route.request is None else await parse_body(request, route.request)
            deadline_ts = getattr(body, "deadline_ts", None)
            if deadline_ts is not None:
                self._refuse_far(deadline_ts)
            with tracing.server_span(
                route.name,
                request.headers,
                attributes={"rollout.instance": plane.settings.instance},
            ):
                unread = fields_unread_by(request.headers.get(CAPABILITIES_HEADER), body)
                return json_reply(await handler(body), unread=unread)

        return endpoint

    def _gym_endpoint(
        self, codec: gym.GymCodec, handler: Handler
    ) -> Callable[[Request], Awaitable[Response]]:
        """The Gym form of a route: Gym's body mapped to ours, the same handler, our reply
        mapped to Gym's; every refusal answered with Gym's error body and code."""
        from . import _gym as gym

        plane = self._plane
        settings = plane.settings
        side = gym.ServerSide(
            instance=settings.instance,
            storage_dir=settings.storage_dir,
            checkpoint_root=None
            if settings.checkpoint_root is None
            else str(settings.checkpoint_root),
            dialects=tuple(dialect.value for dialect in settings.dialects),
            attempt=lambda: plane.attempt,
            open_checkpoint=lambda: plane.checkpoint_id,
        )

        async def endpoint(request: Request) -> Response:
            try:
                authorize(plane.settings, request.headers.get("authorization"))
                body = None if codec.request is None else await parse_body(request, codec.request)
                deadline_ts = getattr(body, "deadline_ts", None)
                if deadline_ts is not None:
                    self._refuse_far(deadline_ts)
                try:
                    ours = codec.to_ours_request(body, side)
                except gym.Unmappable as error:
                    raise ProtocolError(error.code, str(error)) from None
                return json_reply(codec.to_gym_reply(await handler(ours), body, side))
            except ProtocolError as error:
                return gym_error_response(gym.participant_refusal(error, side))

        return endpoint

    def _capabilities_endpoint(self) -> Callable[[Request], Awaitable[Response]]:
        from . import _gym as gym

        plane = self._plane
        settings = plane.settings
        capabilities = gym.GymCapabilities(
            checkpoint=True,
            operations=[route.name for route in ROUTES if route.in_gym],
            lease_grace_seconds=settings.lease_grace_seconds,
            dialects=[dialect.value for dialect in settings.dialects],
        )

        async def endpoint(request: Request) -> Response:
            try:
                authorize(plane.settings, request.headers.get("authorization"))
            except ProtocolError as error:
                return gym_error_response(error)
            return json_reply(capabilities)

        return endpoint

    def _refuse_far(self, deadline_ts: float) -> None:
        """A deadline beyond the horizon would open a lease that, in practice, never lapses."""
        horizon = self._plane.settings.max_deadline_seconds
        if deadline_ts > self._clock() + horizon:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"deadline_ts: {deadline_ts:.6g} is more than {horizon:g}s ahead "
                "(ROLLOUT_MAX_DEADLINE_SECONDS); send a nearer deadline and renew",
            )
