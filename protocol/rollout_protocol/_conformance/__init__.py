"""The conformance kit's implementation, one module per concern (the report, the connections,
each group of scenarios, the runner, in-process serving); its public surface is
`rollout_protocol.conformance`, which server authors import (docs/sdk.md, section 7)."""
