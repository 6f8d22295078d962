{{/*
Names and labels. The full name is the release name when it already contains the chart name,
so `helm install rollout-operator ...` does not yield "rollout-operator-rollout-operator".
*/}}
{{- define "rollout-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollout-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rollout-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollout-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rollout-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rollout-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: rollout-checkpoint-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rollout-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rollout-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rollout-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Whether the replicas coordinate through Kopf peering (more than one) or run standalone. */}}
{{- define "rollout-operator.peering" -}}
{{- if gt (int .Values.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{/* The Lease in the release namespace that the standalone operator holds while it works. */}}
{{- define "rollout-operator.leaderLease" -}}
{{- include "rollout-operator.fullname" . }}-leader
{{- end -}}

{{- define "rollout-operator.namespaced" -}}
{{- if eq .Values.watch.mode "namespaced" -}}true{{- end -}}
{{- end -}}

{{/*
RBAC, in two parts so cluster mode (one ClusterRole) and namespaced mode (a Role per watched
namespace plus a small ClusterRole) grant exactly the same verbs. One rule per resource, each
with the reason it is needed; tests/e2e/test_rbac.py removes each verb in turn and shows that
the operator then hits a 403. Keep both in step with the code (cluster/, flows/setpass.py,
flows/checkpoint/, flows/recovery/, handlers/) and with Kopf.
*/}}
{{- define "rollout-operator.namespacedRules" -}}
# Kopf: list and watch the sets (the operator reads them from that watch); patch adds and removes
# its finalizer and keeps handler progress in annotations (the policy also records a settled
# deadline there). The operator: get reads a set past the watch before a destructive decision
# (is a deleted pod lost, or did a suspend delete it?) and after a write refused as stale.
- apiGroups: [checkpoint.rollout.dev]
  resources: [rolloutsets]
  verbs: [get, list, watch, patch]
# The reconcile, recovery and checkpoint flows write the set's status (merge patches with a
# resourceVersion precondition).
- apiGroups: [checkpoint.rollout.dev]
  resources: [rolloutsets/status]
  verbs: [patch]
# Kopf: list, watch and finalizer patches, as for sets (one daemon per checkpoint; the flows read
# checkpoints from that watch). The checkpoint policy creates checkpoints (trainer steps,
# intervals, the deadline, evictions) and deletes them (retention, and the set's finalizer removes
# its checkpoints first).
- apiGroups: [checkpoint.rollout.dev]
  resources: [rolloutcheckpoints]
  verbs: [list, watch, create, patch, delete]
# The checkpoint flow persists its phase and conditions, and publishes, in status.
- apiGroups: [checkpoint.rollout.dev]
  resources: [rolloutcheckpoints/status]
  verbs: [patch]
# One checkpoint at a time per set: the Lease <set>-checkpoint names the running one. The flow
# creates it, patches it with a resourceVersion precondition (compare-and-swap) to take and
# release the slot, and reads it when a patch was refused or after an operator restart.
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, patch]
{{- if .Values.rbac.ownerReferencesPermissionEnforcement }}
# OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on the owner references of
# pods, Services and Secrets needs update on the owning set's finalizers.
- apiGroups: [checkpoint.rollout.dev]
  resources: [rolloutsets/finalizers]
  verbs: [update]
{{- end }}
# Participant pods: list and watch (Kopf's pod events wake the set; a terminating pod starts an
# eviction checkpoint), create the pods of an attempt, delete the pods of a lost attempt in
# recovery and of a suspended set, and patch their metadata: the latest-checkpoint annotations
# after every Ready checkpoint (the set's pass), and the attempt label of the pods an InPlace recovery keeps.
# Never update: a pod's spec is never changed, pods are replaced.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete, patch]
# One Service per role; created once and removed with the set by owner references.
- apiGroups: [""]
  resources: [services]
  verbs: [create]
# The per-set control-token Secret: created once, read by the checkpoint and recovery flows. A
# bucket set's credentials Secret is only read to check its keys exist (the operator never uses
# them: the participants and cleanup pods that mount it remove the set's keys).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# Kubernetes Events on every transition of sets and checkpoints (posted through Kopf).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Kueue: a set labelled kueue.x-k8s.io/queue-name is a Kueue workload the operator owns (the
# external-framework contract). Kopf lists and watches the sets' Workloads (the operator reads
# them from that watch; their admission and eviction wake the set's pass); the pass creates its
# set's Workload (one per set, deleted with the set by owner reference). Harmless where Kueue
# is not installed.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list, watch, create]
# Kueue: once an evicted set has saved its suspend checkpoint and released its pods, the pass
# clears the Workload's quota reservation in status, which is what Kueue waits for.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- if and (include "rollout-operator.peering" .) (include "rollout-operator.namespaced" .) }}
# Kopf peering of the replicas: watch the namespace's KopfPeering, patch own keep-alives in.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}

{{- define "rollout-operator.clusterRules" -}}
# Nodes are cluster-scoped: a participant on a NotReady node is lost (recovery reads its node from
# Kopf's watch of nodes, which also wakes every set at once when a node goes NotReady).
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch]
# Kueue (cluster-scoped): the WorkloadPriorityClass a queued set names gives its Workload's
# priority; the ResourceFlavors Kueue admitted it on give its pods' node selector and tolerations.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloadpriorityclasses]
  verbs: [get]
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors]
  verbs: [get]
# Kopf watches CRDs so that CRDs applied while it runs (an upgrade) are served without a restart.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if include "rollout-operator.namespaced" . }}
# Namespaced mode: Kopf watches namespaces so that a watched namespace deleted and created again
# is served again without a restart (without it Kopf only logs a warning and falls back).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- if and (include "rollout-operator.peering" .) (not (include "rollout-operator.namespaced" .)) }}
# Kopf peering of the replicas: watch the ClusterKopfPeering, patch own keep-alives in.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}

{{/* The namespaces NetworkPolicies go to: explicit, else the watched ones in namespaced mode. */}}
{{- define "rollout-operator.networkPolicyNamespaces" -}}
{{- $namespaces := .Values.networkPolicy.namespaces -}}
{{- if and (not $namespaces) (include "rollout-operator.namespaced" .) -}}
{{- $namespaces = .Values.watch.namespaces -}}
{{- end -}}
{{- toJson $namespaces -}}
{{- end -}}
