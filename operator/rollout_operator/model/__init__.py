"""The API and the operator's settings (DESIGN 6.0, the bottom layer): the RolloutSet and
RolloutCheckpoint models, their conditions, the CRDs generated from them, and the configuration
of a run. No I/O; everything else imports from here."""
