{{/*
Chart name, possibly overridden; at most 63 characters (a DNS label).
*/}}
{{- define "zarrlake-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects. A release whose name already contains the chart name is not
repeated ("zarrlake-operator", not "zarrlake-operator-zarrlake-operator").
*/}}
{{- define "zarrlake-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"name-version" for the helm.sh/chart label.
*/}}
{{- define "zarrlake-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that select the operator pods; they never change over the life of a release.
*/}}
{{- define "zarrlake-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "zarrlake-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The recommended labels, on every object of the release.
*/}}
{{- define "zarrlake-operator.labels" -}}
helm.sh/chart: {{ include "zarrlake-operator.chart" . }}
{{ include "zarrlake-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: zarrlake
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The ServiceAccount the operator runs as.
*/}}
{{- define "zarrlake-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "zarrlake-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "zarrlake-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The maintenance job image: jobImage, or else the operator image.
*/}}
{{- define "zarrlake-operator.jobImage" -}}
{{- default (include "zarrlake-operator.image" .) .Values.jobImage }}
{{- end }}

{{/*
The image of the repositories' HTTP servers (spec.serve): serve.image, or else the job image.
*/}}
{{- define "zarrlake-operator.serveImage" -}}
{{- default (include "zarrlake-operator.jobImage" .) .Values.serve.image }}
{{- end }}

{{/*
The Lease the replicas elect their leader on, in the release namespace.
*/}}
{{- define "zarrlake-operator.leaseName" -}}
{{- default (include "zarrlake-operator.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
True (non-empty) when the operator watches every namespace.
*/}}
{{- define "zarrlake-operator.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{- end }}
{{- end }}

{{/*
RBAC rules for what the operator does inside each namespace it serves. Kept to the verbs the
operator uses; no wildcards.
*/}}
{{- define "zarrlake-operator.namespacedRules" -}}
# The zarrlake resources: watch, and patch (Kopf's finalizers and progress annotations).
- apiGroups: ["zarrlake.io"]
  resources: ["repositories", "branches", "tags", "retentionpolicies", "mirrors"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["zarrlake.io"]
  resources:
    - "repositories/status"
    - "branches/status"
    - "tags/status"
    - "retentionpolicies/status"
    - "mirrors/status"
  verbs: ["patch"]
# Children are created with owner references that block the owner's deletion; clusters with the
# OwnerReferencesPermissionEnforcement admission plugin (e.g. OpenShift) require this for that.
- apiGroups: ["zarrlake.io"]
  resources:
    - "repositories/finalizers"
    - "branches/finalizers"
    - "tags/finalizers"
    - "retentionpolicies/finalizers"
    - "mirrors/finalizers"
  verbs: ["update"]
# S3 credentials and lock passwords are read by name; lock-password Secrets are created once
# (never rewritten) and deleted when a repository stops using a managed lock service. No list:
# the operator never needs to see Secrets it was not pointed at.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
# The managed Redis lock service and the HTTP server (spec.serve) of each Repository, and the
# replicator of each Mirror (read, create, correct drift, remove).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
# The managed Redis' PodDisruptionBudget and NetworkPolicy, and its PersistentVolumeClaim when the
# Repository asks to persist it (made once, never rewritten).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "delete"]
# The retention / GC / compaction schedules of each RetentionPolicy (listed by label to suspend
# them when their Repository is gone; watched, so an idle resync compares without a request),
# and their runs (watched for results).
- apiGroups: ["batch"]
  resources: ["cronjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# A commit service that runs checks as Jobs (spec.commitService.checks) gets a Role to create,
# read and delete them: Kubernetes lets the operator grant only rights it holds itself.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Job pods' termination messages carry the maintenance results and the checks' verdicts.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# The ServiceAccount, Role and RoleBinding of such a commit service (and, with spark.rbac, of
# each policy's Spark driver).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
{{- if .Values.spark.rbac }}
# engine: spark. With the Spark operator: ScheduledSparkApplications (and a look at their runs).
- apiGroups: ["sparkoperator.k8s.io"]
  resources: ["scheduledsparkapplications"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["sparkoperator.k8s.io"]
  resources: ["sparkapplications"]
  verbs: ["get", "list", "watch"]
# The driver pods of those runs carry the reports (watched by label).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# The rights the driver's Role (per policy) gives it for its executors: Kubernetes lets the
# operator create a Role only with rights it holds.
- apiGroups: [""]
  resources: ["pods", "services", "configmaps", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
{{- end }}
# Kopf posts core v1 Events; a commit service's Role lets it post them and count repeats
# (patch), which the operator may grant only as it holds them.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
RBAC rules for what Kopf reads cluster-wide in either mode: CRDs (to discover the resources it
serves) and namespaces (to resolve the namespaces it serves).
*/}}
{{- define "zarrlake-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}
