"""Participant side of checkpointing: protocol, control plane, servers, coordinator, client."""
