#!/usr/bin/env bash
# Install the Debian packages named as arguments: from the package lists as they are, else after
# `apt-get update`. The Makefile runs it under a lock (APT_INSTALL), so that build targets made
# at the same time never run two apt-gets at once.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
install "$@" || { apt-get update -qq && install "$@"; }
