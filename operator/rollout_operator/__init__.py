"""The Rollout Checkpoint Operator: Kopf handlers, API models and CRD generation."""
