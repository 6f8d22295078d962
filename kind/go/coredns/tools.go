//go:build tools

// Package tools pins CoreDNS for kind/build.sh, which builds github.com/coredns/coredns.
package tools

import _ "github.com/coredns/coredns"
