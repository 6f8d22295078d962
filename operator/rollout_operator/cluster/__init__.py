"""The only code that talks to the API server (docs/design.md#60-layers): the client (`kube.Kube`),
the watches' view of the cluster (`cache`), the per-set checkpoint Lease (`leases`), operations on
the objects a set owns (`objects`), and where the operator sees a set's volume (`storage`)."""
