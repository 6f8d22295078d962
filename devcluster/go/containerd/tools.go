//go:build tools

// Package tools pins the container runtime commands this wrapper module builds:
// containerd, its runc shim and the ctr client.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
