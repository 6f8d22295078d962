//go:build tools

// Package tools pins the S3-compatible server this wrapper module builds.
package tools

import _ "github.com/versity/versitygw/cmd/versitygw"
