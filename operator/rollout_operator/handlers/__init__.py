"""Kopf handlers. Importing this package registers every handler with Kopf's default registry.

Handlers stay thin: they read the event and wake or call the flows (`flows.setpass`,
`flows.policypass`, `flows.checkpoint`, ...), which decide through `decide` and write status. Add a
module here and import it below to register its handlers.
"""

from ..handlers import indexes, policy, rolloutcheckpoint, rolloutset, runtime

__all__ = ["indexes", "policy", "rolloutcheckpoint", "rolloutset", "runtime"]
