{{/*
Names: <fullname>-<component>. fullname stays within 36 characters so that a StatefulSet of a role
(<fullname>-<role>, role names up to 12 characters) fits the 52 its pods' revision label allows.
*/}}
{{- define "ninfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 36 | trimSuffix "-" -}}
{{- end -}}

{{- define "ninfer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 36 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 36 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 36 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* All labels of one component's objects: (dict "root" $ "component" "engine" ["role" name]) */}}
{{- define "ninfer.labels" -}}
{{ include "ninfer.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "engine" ["role" name]) */}}
{{- define "ninfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ninfer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .role }}
ninfer-role: {{ . }}
{{- end }}
{{- end -}}

{{- define "ninfer.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The engine roles that are on, as a sorted list of names */}}
{{- define "ninfer.enabledRoles" -}}
{{- $names := list -}}
{{- range $name, $role := .Values.roles -}}
{{- if $role.enabled -}}{{- $names = append $names $name -}}{{- end -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* Enabled roles of one mode: (dict "root" $ "mode" "both") -> JSON list of names */}}
{{- define "ninfer.rolesOfMode" -}}
{{- $names := list -}}
{{- range $name, $role := .root.Values.roles -}}
{{- if and $role.enabled (eq $role.mode $.mode) -}}{{- $names = append $names $name -}}{{- end -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* host:port of each pod of a role, by its StatefulSet DNS name: (dict "root" $ "role" name) -> JSON list */}}
{{- define "ninfer.roleAddresses" -}}
{{- $root := .root -}}
{{- $sts := printf "%s-%s" (include "ninfer.fullname" $root) .role -}}
{{- $addresses := list -}}
{{- range $i := until (int (index $root.Values.roles .role).replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc.%s:%d" $sts $i $sts $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.engine.grpcPort)) -}}
{{- end -}}
{{- toJson $addresses -}}
{{- end -}}

{{/* The OTLP/gRPC endpoint the processes export to ("" = none) */}}
{{- define "ninfer.otlpEndpoint" -}}
{{- if .Values.otel.collector.enabled -}}
{{- printf "http://%s-otel-collector.%s.svc.%s:%d" (include "ninfer.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.otel.collector.port) -}}
{{- else -}}
{{- .Values.otel.endpoint -}}
{{- end -}}
{{- end -}}

{{/* Environment every ninfer process gets: (dict "root" $ "service" "ninfer-engine" "attributes" "ninfer.role=x") */}}
{{- define "ninfer.commonEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: OTEL_SERVICE_NAME
  value: {{ .service }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)%s" (ternary (printf ",%s" .attributes) "" (ne .attributes "")) | quote }}
{{- with include "ninfer.otlpEndpoint" .root }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* --metrics-listen's value */}}
{{- define "ninfer.metricsListen" -}}
{{- if .root.Values.metrics.enabled -}}{{- printf "0.0.0.0:%d" (int .port) -}}{{- else -}}off{{- end -}}
{{- end -}}

{{/* prometheus.io/* pod annotations: (dict "root" $ "port" 9401) */}}
{{- define "ninfer.scrapeAnnotations" -}}
{{- if and .root.Values.metrics.enabled .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/*
Refusals, each naming the value to change. Called once from NOTES.txt and from every template that
depends on them, so that `helm template` fails as `helm install` does.
*/}}
{{- define "ninfer.checks" -}}
{{- $roles := include "ninfer.enabledRoles" . | fromJsonArray -}}
{{- $both := include "ninfer.rolesOfMode" (dict "root" . "mode" "both") | fromJsonArray -}}
{{- $prefill := include "ninfer.rolesOfMode" (dict "root" . "mode" "prefill") | fromJsonArray -}}
{{- $decode := include "ninfer.rolesOfMode" (dict "root" . "mode" "decode") | fromJsonArray -}}
{{- if not $roles -}}
{{- fail "roles: no engine role is enabled (set roles.<name>.enabled=true)" -}}
{{- end -}}
{{- if or $prefill $decode -}}
{{- if $both -}}
{{- fail (printf "roles: %v are mode=both and %v prefill/decode; one deployment is either disaggregated or not" $both (concat $prefill $decode)) -}}
{{- end -}}
{{- if or (not $prefill) (not $decode) -}}
{{- fail "roles: prefill/decode disaggregation needs at least one enabled role of mode=prefill and one of mode=decode" -}}
{{- end -}}
{{- if .Values.gateway.enabled -}}
{{- fail "gateway.enabled: ninfer's gateway runs prefill and decode on one engine; prefill/decode roles need router.enabled (smg --pd-disaggregation)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.router.enabled .Values.engine.auth.apiKeySecret -}}
{{- fail "engine.auth.apiKeySecret: smg 1.13 sends no credentials to its workers, so engines with a key refuse the router (UNAUTHENTICATED); leave it empty with router.enabled (docs/smg.md)" -}}
{{- end -}}
{{- if and (not .Values.engine.auth.apiKeySecret) (not .Values.engine.auth.allowUnauthenticated) -}}
{{- fail "engine.auth: the engines listen on 0.0.0.0 without a key; set engine.auth.apiKeySecret, or engine.auth.allowUnauthenticated=true to say so" -}}
{{- end -}}
{{- if and .Values.gateway.enabled (not .Values.gateway.auth.apiKeySecret) (not .Values.gateway.auth.allowUnauthenticated) -}}
{{- fail "gateway.auth: the gateway listens on 0.0.0.0 without a key; set gateway.auth.apiKeySecret, or gateway.auth.allowUnauthenticated=true to say so" -}}
{{- end -}}
{{- if and .Values.smokeTest.enabled (not .Values.router.enabled) (not .Values.gateway.enabled) -}}
{{- fail "smokeTest.enabled: the smoke test sends its request through router or gateway; enable one" -}}
{{- end -}}
{{- range $name := $roles -}}
{{- $role := index $.Values.roles $name -}}
{{- $scaling := $role.autoscaling | default $.Values.engine.autoscaling -}}
{{- if $scaling.enabled -}}
{{- if $.Values.gateway.enabled -}}
{{- fail (printf "roles.%s.autoscaling: ninfer's gateway takes a fixed --engine list, so pods an HPA adds would get no traffic; autoscale behind router.discovery=kubernetes" $name) -}}
{{- end -}}
{{- if and $.Values.router.enabled (ne $.Values.router.discovery "kubernetes") -}}
{{- fail (printf "roles.%s.autoscaling: router.discovery=static lists the pods of `replicas`, so pods an HPA adds would get no traffic; set router.discovery=kubernetes" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
