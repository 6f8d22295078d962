"""A real local Kubernetes control plane built from Go modules, and a node agent that runs
pods as local processes: see docs/devcluster.md."""
