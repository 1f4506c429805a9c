{{/* Names and labels shared by every template. */}}

{{- define "rl.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "rl.runName" -}}
{{- default .Release.Name .Values.run.name -}}
{{- end -}}

{{- define "rl.labels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: colocated-rl
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rl.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* The sandbox service's pods carry the label its pod backend's NetworkPolicy admits. */}}
{{- define "rl.sandboxSelector" -}}
app.kubernetes.io/name: rl-sandbox-service
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The headless Service's name resolves to every ready replica; the client spreads runs over them. */}}
{{- define "rl.sandboxAddress" -}}
{{- printf "dns:///%s-sandbox.%s.svc:%v" (include "rl.fullname" .) .Release.Namespace .Values.sandbox.port -}}
{{- end -}}

{{- define "rl.claimName" -}}
{{- default (printf "%s-data" (include "rl.fullname" .)) .Values.storage.existingClaim -}}
{{- end -}}

{{/* Colocated workers: each GPU of a worker pod is one; a pod without GPUs is one. */}}
{{- define "rl.workers" -}}
{{- $n := 0 -}}
{{- range .Values.workerGroups -}}
{{- $n = add $n (mul .replicas (max 1 (int .gpus))) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{- define "rl.gpusPerWorker" -}}
{{- $g := 0 -}}
{{- range .Values.workerGroups -}}
{{- if gt (int .gpus) 0 }}{{ $g = 1 }}{{ end -}}
{{- end -}}
{{- $g -}}
{{- end -}}

{{/* The run directory; a retried job finds its config.yaml there and resumes. */}}
{{- define "rl.runDir" -}}
{{- printf "%s/runs/%s" .Values.storage.mountPath (include "rl.runName" .) -}}
{{- end -}}

{{- define "rl.trainArgs" -}}
{{- $args := list "--set" "cluster.ray_address=auto"
      "--set" (printf "cluster.workers=%s" (include "rl.workers" .))
      "--set" (printf "cluster.gpus_per_worker=%s" (include "rl.gpusPerWorker" .))
      "--set" (printf "metrics.prometheus_port=%v" .Values.run.metricsPort) -}}
{{- if .Values.model.path -}}
{{- $args = concat $args (list "--set" (printf "model.path=%s" .Values.model.path)) -}}
{{- end -}}
{{- if .Values.sandbox.enabled -}}
{{- $args = concat $args (list "--set" (printf "sandbox.address=%s" (include "rl.sandboxAddress" .))) -}}
{{- end -}}
{{- $args = concat $args .Values.run.extraArgs -}}
{{- range $args }} {{ . | squote }}{{ end -}}
{{- end -}}

{{/* Volumes every Ray pod mounts: the run config, the run storage, /dev/shm, the model claim. */}}
{{- define "rl.rayVolumes" -}}
- name: run-config
  configMap:
    name: {{ include "rl.fullname" .root }}-config
- name: data
  persistentVolumeClaim:
    claimName: {{ include "rl.claimName" .root }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- if .root.Values.model.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.existingClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "rl.rayMounts" -}}
- name: run-config
  mountPath: {{ .Values.run.configMountPath }}
  readOnly: true
- name: data
  mountPath: {{ .Values.storage.mountPath }}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.model.existingClaim }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
