"""Participant side of partial-rollout checkpointing: protocol, control plane, servers, coordinator, client."""
