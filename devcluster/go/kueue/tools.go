//go:build tools

// Package tools pins the Kueue controller manager this wrapper module builds.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
