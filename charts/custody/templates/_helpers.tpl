{{/* Chart name, at most 63 characters. */}}
{{- define "custody.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Prefix of every object name: the release name when it already contains the chart name (release
"custody" gives custody-controller), else <release>-<chart>. Cut to 52 characters so that
"<fullname>-metrics", a Service name (a DNS label, at most 63), fits.
*/}}
{{- define "custody.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "custody.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "custody.labels" -}}
helm.sh/chart: {{ include "custody.chart" . }}
app.kubernetes.io/name: {{ include "custody.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: custody
{{- end -}}

{{/* Selector of the controller pods (immutable on a Deployment: never add to it). */}}
{{- define "custody.controllerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "custody.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "custody.controllerLabels" -}}
{{ include "custody.labels" . }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "custody.sweepLabels" -}}
{{ include "custody.labels" . }}
app.kubernetes.io/component: sweep
{{- end -}}

{{/* The controller's ServiceAccount. */}}
{{- define "custody.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-controller" (include "custody.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The one image: the controller runs it and hands it to the sweep CronJobs (--image). */}}
{{- define "custody.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespaces that get the sweep ServiceAccount: the release namespace, then sweep.namespaces. */}}
{{- define "custody.sweepNamespaces" -}}
{{- $out := list .Release.Namespace -}}
{{- range .Values.sweep.namespaces -}}
{{- if not (has . $out) -}}
{{- $out = append $out . -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* PromQL label matcher of this release's controller series (monitoring.selector). */}}
{{- define "custody.monitoringSelector" -}}
{{- .Values.monitoring.selector | default (printf "job=%q" (printf "%s-metrics" (include "custody.fullname" .))) -}}
{{- end -}}
