"""The checkpoint policy, decided (`checkpointPolicy` and `suspend`: docs/policy.md): one module per
policy, as pure functions.

- `views`: what the policies read (`SetView`, `CheckpointView`, the settled `DeadlineRecord`) and
  what they decide (`Create`, `ConditionChange`, `Note`).
- `trainerstep`: a TrainerCheckpoint for a newly reported trainer step.
- `interval`: an Interval checkpoint `intervalSeconds` after the last one ended.
- `deadline`: the `mustSaveBy` checkpoint and its save reserve.
- `suspend`: `spec.suspend` and `afterDeadline: Suspend` (checkpoint, release, resume).
- `eviction`: an Eviction checkpoint for a participant pod being deleted, and its prepare deadline.
- `retention`: which finished checkpoints to delete (`keepLatest`).
- `plan`: all of them for one look at a set, in the order where decisions meet.

Everything here is pure: views of a RolloutSet and of its RolloutCheckpoints go in, together with
`now`; decisions come out (which checkpoint to create under which name, what to delete, which
condition to show, when to look again). `flows.policypass` reads the objects and carries the
decisions out; the Kopf handlers in `handlers/policy.py` only wake it. Keeping the decisions pure is
what lets the unit tests drive a deadline, an overtaken wait or a suspend through every branch with
an injected clock and no API server.

Three rules shape every decision:

- **Names are deterministic.** Every checkpoint the policy creates is named after what caused it
  (`<set>-step-<N>`, `<set>-interval-<due time>`, `<set>-deadline-<mustSaveBy>`,
  `<set>-evict-a<attempt>`, `<set>-suspend-a<attempt>`), so an operator that crashed after the
  create and decides again gets "exists already" instead of a second checkpoint.
- **The state lives in the API.** What was decided before is read back from the objects (the
  checkpoints, the set's status and one annotation for a settled deadline), never kept in
  memory, so a restarted operator decides the same.
- **One checkpoint at a time per set** (docs/design.md#66-one-checkpoint-at-a-time): the policy
  never starts a timer checkpoint while another one of the set is unfinished; the checkpoint flow
  queues the others.
"""
