"""Pure decisions (docs/design.md#60-layers): the checkpoint policy, the plan of an attempt's pods,
the InPlace plan, the churn bound, the work a recovery loses, the set's checkpoint fields, and the
manifests of the objects a set owns. No I/O; time comes in as an argument."""
