"""What the operator does, as flows over the cluster layer (docs/design.md#60-layers): the set's
pass (`setpass`), the checkpoint policy's pass (`policypass`), a checkpoint (`checkpoint`), a
recovery (`recovery`) and a Kueue-queued set's pass (`queuepass`). The five never import each other
(an import-linter contract in `make lint`); they share `repairs` (status written by hand, checked
against the cluster), `watching` and `passloop`."""
