"""What the operator does, as flows over the cluster layer (docs/design.md#60-layers): the set's
pass (`setpass`), the checkpoint policy's pass (`policypass`), a checkpoint (`checkpoint`), a
recovery (`recovery`) and a Kueue-queued set's pass (`queuepass`). The five never import each other
(an import-linter contract in `make lint`); they share `checkpointrepairs` (a checkpoint's status
written by hand, checked against storage; the set's status has its repairs in its owners),
`records`, `watching`, `passloop` and `state` (the process's `OperatorState`, which they are
handed: docs/design.md#611-the-operators-in-process-state). `reconciler` composes them: the order
of the passes in each per-set loop."""
