// An in-cluster client for devcluster's container-node tests: the test image's busybox cannot
// speak the TLS the API server offers, so this static binary stands in for a pod's own client.
module rollout.dev/devcluster/whoami

go 1.26.0
