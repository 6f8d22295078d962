"""The API and the operator's settings (the bottom layer: docs/design.md#60-layers): the RolloutSet
and RolloutCheckpoint models, their conditions, the CRDs generated from them, and the configuration
of a run. No I/O; everything else imports from here."""
