// The sandbox ("pause") process of devcluster's container node: containerd needs a sandbox
// image and no registry is reachable, so devcluster builds its own from this module.
module rollout.dev/devcluster/pause

go 1.26.0
