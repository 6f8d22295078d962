"""NeMo Gym's stateful counter (`example_session_state_mgmt`, as released in nemo-gym) with the
two routes the adapter's `snapshot` strategy calls (docs/gym.md, "Strategies"): export a
session's state, import it into a fresh session. The released server is subclassed, not
changed; a Gym user adds the same two routes to a server of their own.

Run by the resources pod: `rollout-gym resources --server snapshot_counter:SnapshotCounter ...`
with this folder on `PYTHONPATH`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel
from resources_servers.example_session_state_mgmt.app import StatefulCounterResourcesServer


class ImportRequest(BaseModel):
    snapshot: dict[str, Any]


class SnapshotCounter(StatefulCounterResourcesServer):  # type: ignore[misc]
    """The released counter, plus `/export_session` and `/import_session`."""

    def setup_webserver(self) -> FastAPI:
        app: FastAPI = super().setup_webserver()
        app.post("/export_session")(self.export_session)
        app.post("/import_session")(self.import_session)
        return app

    async def export_session(self, request: Request) -> dict[str, Any]:
        session_id = request.session[SESSION_ID_KEY]
        return {"snapshot": {"count": self.session_id_to_counter.get(session_id)}}

    async def import_session(self, request: Request, body: ImportRequest) -> dict[str, Any]:
        session_id = request.session[SESSION_ID_KEY]
        count = body.snapshot.get("count")
        if count is None:
            self.session_id_to_counter.pop(session_id, None)
        else:
            self.session_id_to_counter[session_id] = int(count)
        return {"imported": True}
