"""The reference rollout servers, the trainer client and discovery, on `rollout_protocol`."""
