# The two commands a newcomer needs: `make demo` and `make test`. Everything they
# rely on (the virtual environment, the control-plane binaries) is built here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN_LINK := .bin/devcluster
NODE_BIN_LINK := .bin/devcluster-node
KUEUE_LINK := .bin/kueue
S3_LINK := .bin/s3
# Debian packages the container node runs (runc, kube-proxy's iptables and conntrack, the test
# image's busybox); `make node-binaries` installs those missing with apt-get.
NODE_DEBS := runc iptables nftables conntrack busybox-static
ENGINE_LINK := .bin/engines
# apt-get under one lock (the script's own file, so nothing is left behind): `make test` builds
# two targets at a time, and two of them may install Debian packages (dpkg takes one at a time;
# a second apt-get would fail on its lock).
APT_INSTALL := flock -w 1800 devcluster/apt-install.sh devcluster/apt-install.sh
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers (TEST_WORKERS=0: one process);
# the container-node tests run whole on one worker (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: kind kind-down kind-packages kind-e2e-docker help venv gym-venv cluster-binaries kueue-binaries s3-server node-packages node-binaries engine image lint test test-unit test-protocol test-e2e test-adversarial demo demo-containers cluster cluster-down crds bench bench-fleet bench-requests clean kind-e2e kind-e2e-down

help:
	@echo "make demo              run the demo on a local devcluster (add DEMO_ARGS=--keep to leave it up;"
	@echo "                       S3=1: with an S3 server and a bucket on loopback)"
	@echo "make test              lint, type-check and run every test (unit, protocol, e2e)"
	@echo "make test-unit         only the fast tests"
	@echo "make test-adversarial  only the hostile inputs and fault timings (tests/adversarial)"
	@echo "make cluster-binaries  build the pinned control-plane binaries (cached per machine)"
	@echo "make kueue-binaries    build Kueue's controller (pinned sigs.k8s.io/kueue; cached per machine)"
	@echo "make s3-server         build the S3-compatible server the object-storage tests use (pinned versitygw; cached)"
	@echo "make node-binaries     build the container node (kubelet, kube-proxy, containerd, CNI; cached)"
	@echo "make engine            build llama.cpp's llama-server for the engine tests (cached per machine)"
	@echo "make gym-venv          build the NeMo Gym environments (nemo-gym 0.4 and 0.7, the SDK, the adapter; cached)"
	@echo "make demo-containers   the demo on a container node: servers in containers, operator by Helm"
	@echo "make image             build the project's image from the Dockerfile with buildah (cached per inputs)"
	@echo "make cluster           start a devcluster in .devcluster/ and print the KUBECONFIG line (S3=1: and an S3 server)"
	@echo "make cluster-down      stop it"
	@echo "make kind              a kind cluster (1 control plane + KIND_WORKERS=2 workers), the operator by Helm"
	@echo "make kind-down         remove it, with everything it put on the machine"
	@echo "make crds              regenerate crds/ from the API models"
	@echo "make bench             run the benchmarks (printed tables)"
	@echo "make bench-fleet       one operator, 100 RolloutSets of 16 fleet pods (FLEET_ARGS=...)"
	@echo "make bench-requests    API requests and operator CPU per checkpoint (REQUESTS_ARGS=--baseline-ref REF)"

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,engine]'
	@# devcluster/ and harness/ are not in the wheel; the checkout's venv finds them through this .pth
	@# gym/ too: the Gym adapter's modules are linted and type-checked here (nemo-gym is not installed)
	@printf '%s\n' "$(CURDIR)" "$(CURDIR)/gym" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rollout-checkout.pth"
	@touch $@

venv: $(VENV)/.installed

# The NeMo Gym environments (docs/gym.md, "Gym releases"), one per release the adapter supports:
# nemo-gym 0.4 on Python >= 3.12 (gym/requirements.txt, gym/constraints.txt; .bin/gym-venv) and
# 0.7 on Python 3.13 (gym/requirements-0.7.txt, gym/constraints-0.7.txt; .bin/gym-venv-0.7), each
# with this checkout's SDK and Gym adapter; cached in ~/.cache/rollout-gym/ by a digest of those
# inputs (gym/build-venv.sh). The tests run the adapter on both; the Gym pods on devcluster run
# 0.4's interpreter (.bin/gym-venv/bin/python). Cold: about 2-2.5 minutes each.
gym-venv:
	@mkdir -p .bin
	@dir="$$(gym/build-venv.sh 0.4 | tail -n 1)" && ln -sfn "$$dir" .bin/gym-venv \
	  && echo "[gym] nemo-gym 0.4 environment in $$dir (linked as .bin/gym-venv)"
	@dir="$$(gym/build-venv.sh 0.7 | tail -n 1)" && ln -sfn "$$dir" .bin/gym-venv-0.7 \
	  && echo "[gym] nemo-gym 0.7 environment in $$dir (linked as .bin/gym-venv-0.7)"

cluster-binaries:
	@mkdir -p .bin
	@bindir="$$(devcluster/build-binaries.sh | tail -n 1)" && ln -sfn "$$bindir" $(BIN_LINK) \
	  && echo "[devcluster] binaries in $$bindir (linked as $(BIN_LINK))"

# Kueue's controller manager (sigs.k8s.io/kueue at the pin in devcluster/go/kueue) with its CRDs,
# for `python -m devcluster up --kueue`, the e2e suite (its CRDs, the Kueue tests) and the Kueue
# bench; cached per machine like the above. Only the targets that use it build it: `make demo`
# never waits for it.
kueue-binaries:
	@mkdir -p .bin
	@dir="$$(devcluster/build-kueue.sh | tail -n 1)" && ln -sfn "$$dir" $(KUEUE_LINK)

# The S3-compatible server (versitygw at the pin in devcluster/go/s3, its posix backend) that the
# object-storage tests start on loopback (tests/testsupport/s3_server.py) and the bucket demo runs;
# cached per machine like the above.
s3-server:
	@mkdir -p .bin
	@bindir="$$(devcluster/build-s3.sh | tail -n 1)" && ln -sfn "$$bindir" $(S3_LINK) \
	  && echo "[devcluster] S3 server in $$bindir (linked as $(S3_LINK))"

# The container node (`python -m devcluster up --node-runtime containerd`): its Debian packages
# when missing, then kubelet, kube-proxy, containerd and the CNI plugins from pinned Go modules.
node-packages:
	@$(APT_INSTALL) devcluster $(NODE_DEBS)

node-binaries: cluster-binaries node-packages
	@bindir="$$(devcluster/build-node-binaries.sh | tail -n 1)" && ln -sfn "$$bindir" $(NODE_BIN_LINK) \
	  && echo "[devcluster] node binaries in $$bindir (linked as $(NODE_BIN_LINK))"

# llama.cpp's server, for the engine protocol tests (tests/protocol/test_engine_continuation.py);
# the first build took 565 s (download, configure, 206 compile steps) on two cores shared with
# other test runs; later runs find it cached.
engine: venv
	@mkdir -p .bin
	@bindir="$$(engines/build-llama-server.sh $(PY) | tail -n 1)" && ln -sfn "$$bindir" $(ENGINE_LINK) \
	  && echo "[engines] llama-server in $$bindir (linked as $(ENGINE_LINK))"

# The project's image, built from the Dockerfile by buildah on a Debian base made by mmdebstrap
# (no registry base image can be pulled here); cached in ~/.cache/rollout-images/<inputs digest>/.
# Cold (base + image) it took 107-119 s on two shared cores, cached 1.7 s; see image/build.sh.
image:
	@# runc: tests/containers runs a container of the image with buildah (oci isolation)
	@command -v buildah >/dev/null && command -v mmdebstrap >/dev/null && command -v runc >/dev/null || { \
	  echo "[image] installing buildah, mmdebstrap and runc (Debian packages)"; \
	  $(APT_INSTALL) image buildah mmdebstrap runc; }
	@mkdir -p .bin
	@dir="$$(image/build.sh | tail -n 1)" && ln -sfn "$$dir" .bin/image \
	  && echo "[image] archive in $$dir (linked as .bin/image)"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test-unit: venv cluster-binaries s3-server
	$(VENV)/bin/pytest -m unit $(PYTEST_ARGS)

test-protocol: venv engine s3-server
	$(VENV)/bin/pytest -m protocol $(PYTEST_ARGS)

test-e2e: venv cluster-binaries kueue-binaries s3-server node-binaries
	$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS)

# tests/adversarial is collected by plain `pytest` (make test) too; its API-server cases are e2e.
test-adversarial: venv cluster-binaries s3-server
	$(VENV)/bin/pytest -m adversarial $(PYTEST_ARGS)

# tests/kind is not in `make test`: 6 minutes warm on two cores (8.5 under load) against a
# budget of about 4, and 10-16 cold minutes against cold CI's 10 left; `make kind-e2e` runs it
# (docs/kind.md, "Why tests/kind is not in make test: the floor").
# Its builds run two at a time (each is cached per machine; cold on two cores they took 33
# minutes so, about 45 one after another), then lint, then the suite.
TEST_BUILDS := venv cluster-binaries kueue-binaries s3-server node-binaries engine image gym-venv
test:
	@$(MAKE) --no-print-directory -j2 $(TEST_BUILDS)
	@$(MAKE) --no-print-directory lint
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --ignore=tests/kind $(PYTEST_ARGS)

# S3=1: the cluster also runs an S3 server on loopback with a bucket (devcluster/s3.py).
demo: venv cluster-binaries $(if $(S3),s3-server)
	$(PY) -m harness.demo $(if $(S3),--s3) $(DEMO_ARGS)

# The same scenario on the container node: the servers as containers of the project's image, the
# operator installed by Helm as a pod of it (first run: make node-binaries and make image build).
demo-containers: venv cluster-binaries node-binaries image
	$(PY) -m harness.demo --node-runtime containerd $(DEMO_ARGS)

cluster: venv cluster-binaries $(if $(S3),s3-server)
	$(PY) -m devcluster up --dir .devcluster $(if $(S3),--s3)

cluster-down: venv
	$(PY) -m devcluster down --dir .devcluster

crds: venv
	$(PY) -m rollout_operator.model.crdgen
	$(PY) -m rollout_operator.model.crdgen --dir charts/rollout-operator/crds

bench: venv cluster-binaries kueue-binaries node-binaries image
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# One operator for 100 RolloutSets x 16 fleet pods (in-process participants; docs/devcluster.md);
# FLEET_ARGS=--sets 20 for a smaller fleet. Also run by `make bench`.
bench-fleet: venv cluster-binaries
	$(PY) bench/fleet.py $(FLEET_ARGS)

# The operator's API requests per checkpoint by verb and resource, and its CPU, for a 4-pod and
# a 16-pod set; REQUESTS_ARGS=--baseline-ref HEAD~1 adds a column for that commit's operator.
# About 1 minute on two cores (2.5 with a baseline). Also run by `make bench`.
bench-requests: venv cluster-binaries
	$(PY) bench/checkpoint_requests.py $(REQUESTS_ARGS)

clean:
	rm -rf $(VENV) .bin .mypy_cache .ruff_cache .pytest_cache

# --- kind: a multi-node cluster (docs/kind.md) ---
# Without Docker (these machines): kind on podman in a network namespace of its own, the node
# image assembled from Debian packages and the binaries above (kind/build-node-image.sh), cached
# under ~/.cache/rollout-kind. With Docker: kind's standard path (kind/up-docker.sh).
KIND_DEBS := podman netavark aardvark-dns mmdebstrap runc iproute2
KIND_WORKERS ?= 2
export KIND_WORKERS

kind-packages:
	@$(APT_INSTALL) kind $(KIND_DEBS)

kind: venv cluster-binaries
	@if docker info >/dev/null 2>&1 && [ -z "$$KIND_PODMAN" ]; then kind/up-docker.sh; \
	  else $(MAKE) --no-print-directory node-binaries image kind-packages && kind/up.sh; fi

kind-down:
	@if [ -e .kind/docker ]; then kind/down-docker.sh; else kind/down.sh; fi

# --- the container suite on a kind cluster (machines with Docker; not run in CI: no Docker here) ---
# The same tests as on devcluster's container node (tests/containers, harness/providers.py), against a
# fresh kind cluster: the image is built by `docker build` and loaded with `kind load image-archive`,
# the node advertises 8 nvidia.com/gpu (node-status patch, as devcluster does). The cluster is
# deleted afterwards; KIND_KEEP=1 keeps it (delete it with make kind-e2e-down). The trainer's
# rollout-collect runs on this machine and dials pod IPs: on Linux that needs a route to kind's pod
# network (docs/containers.md). See docs/containers.md.
KIND ?= kind
KIND_CLUSTER ?= rollout-e2e
KIND_KEEP ?=
KIND_TESTS := tests/containers/test_helm_operator.py tests/containers/test_rolloutset_containers.py

# Without Docker: the multi-node suite (tests/kind) on the podman kind cluster it starts and
# removes itself (docs/kind.md), with the S3 server its bucket scenario runs in the cluster (s3-server).
kind-e2e: venv cluster-binaries
	@if docker info >/dev/null 2>&1 && [ -z "$$KIND_PODMAN" ]; then $(MAKE) --no-print-directory kind-e2e-docker; \
	  else $(MAKE) --no-print-directory node-binaries image kind-packages s3-server && $(VENV)/bin/pytest -m kind tests/kind $(PYTEST_ARGS); fi

kind-e2e-docker: venv cluster-binaries
	$(KIND) create cluster --name $(KIND_CLUSTER) --wait 120s
	$(BIN_LINK)/kubectl --context kind-$(KIND_CLUSTER) patch node $(KIND_CLUSTER)-control-plane \
	  --subresource=status --type=json -p '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"8"}]'
	ROLLOUT_E2E_PROVIDER=kind KIND_CLUSTER=$(KIND_CLUSTER) $(VENV)/bin/pytest -m containers $(KIND_TESTS) -q; \
	  status=$$?; \
	  if [ -z "$(KIND_KEEP)" ]; then $(KIND) delete cluster --name $(KIND_CLUSTER); fi; \
	  exit $$status

kind-e2e-down:
	$(KIND) delete cluster --name $(KIND_CLUSTER)
