"""A real local Kubernetes control plane built from Go modules, plus a node agent that runs pods as processes."""
