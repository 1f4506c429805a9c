{{/* What the run's pods execute: launch.sh (in the run's ConfigMap), the head's init containers, the preStop hook. */}}

{{/* A Ray pod's preStop: on SIGTERM while the run lives (launch.sh's <run dir>/.running), ask the run for a checkpoint
     (<run dir>/stop-requested) and wait until it answers by removing the file, the run ends, or the grace period
     (less 10 s) is spent. Then keep Ray's logs of this pod on the claim (<run dir>/logs/ray/<pod>, files under
     256 MB): the kubelet's rotation loses them with the pod, and KubeRay deletes every pod when the run ends.
     Called with root and ask; a disaggregated run's rollout pod asks nothing (ask false): the run replaces its
     replica and goes on. */}}
{{- define "rl.preStop" -}}
{{- $dir := include "rl.runDir" .root -}}
{{- $wait := sub (int .root.Values.disruption.terminationGracePeriodSeconds) 10 -}}
{{- $keep := `keep() { src=${RL_RAY_LOGS:-/tmp/ray/session_latest/logs}; [ -d "$src" ] && [ -d "$d" ] || return 0; dst="$d/logs/ray/$(hostname)"; mkdir -p "$dst" && (cd "$src" && find . -type f -size -256M -exec cp --parents {} "$dst" \;) 2>/dev/null || true; }` -}}
{{- $ask := printf `live() { [ -e "$d/.running" ] && [ $(( $(date +%%s) - $(stat -c %%Y "$d/.running") )) -lt 60 ]; }; if live; then echo "$(hostname) $(date +%%s)" >> "$d/stop-requested"; t=0; while [ -e "$d/stop-requested" ] && live && [ $t -lt %d ]; do sleep 1; t=$((t+1)); done; fi; ` $wait -}}
preStop:
  exec:
    command:
      - sh
      - -c
      - {{ printf "d=%s; %s; %skeep" ($dir | squote) $keep (ternary $ask "" .ask) | quote }}
{{- end -}}

{{/* The head's init containers, in order: the image's Ray against rayJob.rayVersion; the run volume's owner (with
     storage.fixOwnership) and whether uid 1000 may write it; the model download (model.source). */}}
{{- define "rl.headInitContainers" -}}
{{- $v := .Values -}}
{{- $mount := dict "name" "data" "mountPath" $v.storage.mountPath -}}
{{- $small := dict "requests" (dict "cpu" "10m" "memory" "64Mi") "limits" (dict "memory" "256Mi") -}}
{{- with $v.rayJob.rayVersion }}
# KubeRay decides the head's probes and commands by rayVersion: it must be the image's Ray
- name: check-image
  image: {{ include "rl.image" $ }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - python3
    - -c
    - {{ printf `import sys, ray; sys.exit(None if ray.__version__ == %s else "the image %s has Ray " + ray.__version__ + ", rayJob.rayVersion says %s: set rayJob.rayVersion to the image's")` (. | squote) (include "rl.image" $) . | quote }}
  resources: {{ toJson $small }}
  securityContext:
    {{- include "rl.containerSecurityContext" list | nindent 4 }}
{{- end }}
{{- if $v.storage.fixOwnership }}
# storage.fixOwnership: the storage class ignores fsGroup; give the volume's root to uid 1000 once (not recursive)
- name: volume-owner
  image: {{ include "rl.image" $ }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: [sh, -c, {{ printf "chown 1000:1000 %s && chmod u+rwx %s" $v.storage.mountPath $v.storage.mountPath | quote }}]
  resources: {{ toJson $small }}
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL], add: [CHOWN, FOWNER]}
  volumeMounts: [{{ toJson $mount }}]
{{- end }}
# the first write of the run (the model download, checkpoints) fails otherwise, later and less clearly
- name: check-volume
  image: {{ include "rl.image" $ }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - sh
    - -c
    - {{ printf `test -w %s || { echo "the run volume %s is not writable by uid $(id -u) (owner: $(stat -c %%u:%%g %s)): its storage class ignores fsGroup; set storage.fixOwnership=true, or give the volume to uid 1000 (an EFS access point, the NFS export's owner)" >&2; exit 1; }` $v.storage.mountPath $v.storage.mountPath $v.storage.mountPath | quote }}
  resources: {{ toJson $small }}
  securityContext:
    {{- include "rl.containerSecurityContext" list | nindent 4 }}
  volumeMounts: [{{ toJson $mount }}]
{{- with $v.model.source }}
# downloads model.source once (resumably, checksummed) into the run storage; a retry finds it there
- name: fetch-model
  image: {{ include "rl.image" $ }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: [rl, fetch-model, {{ . | quote }}, --cache, {{ include "rl.modelCache" $ | quote }}]
  {{- with $v.model.credentialsSecret }}
  envFrom:
    - secretRef: {name: {{ . }}}  # HF_TOKEN, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL, ...
  {{- end }}
  resources:
    requests: {cpu: {{ $v.head.cpu | quote }}, memory: {{ $v.head.memory | quote }}}
    limits: {memory: {{ $v.head.memory | quote }}}
  securityContext:
    {{- include "rl.containerSecurityContext" list | nindent 4 }}
  volumeMounts: [{{ toJson $mount }}]
{{- end }}
{{- end -}}

{{/* The run's ConfigMap: named after its content (config.yaml and launch.sh), so that a changed release makes a new
     one instead of changing the files of a running attempt. */}}
{{- define "rl.configName" -}}
{{- printf "%s-config-%s" (include "rl.fullname" .) (printf "%s\n---\n%s" .Values.runConfig (include "rl.launchScript" .) | sha256sum | trunc 10) -}}
{{- end -}}

{{/* launch.sh: one run directory per run (its .owner), each attempt's console on the claim, the preStop's marker
     (.running), the whole run's deadline, `rl train --auto-resume`, the exports, the sandbox's release. */}}
{{- define "rl.launchScript" -}}
{{- $v := .Values -}}
{{- $limit := int $v.rayJob.activeDeadlineSeconds -}}
{{- $export := $v.storage.export -}}
{{- $train := printf "rl train %s --run-dir \"$run_dir\" --auto-resume%s" (printf "%s/config.yaml" $v.run.configMountPath | squote) (include "rl.trainArgs" .) -}}
set -e
# A root RDMA worker (memlock: root, without CAP_DAC_OVERRIDE) saves its shards beside this uid-1000 head: the run
# directory is setgid and what each makes group-writable, so both (the pods' fsGroup is their common group) can add
# to and delete what the other made.
umask 0002
run_dir={{ include "rl.runDir" . | squote }}
owner={{ printf "%s/%s" .Release.Namespace .Release.Name | squote }}
mkdir -p "$run_dir/logs"
chmod 2775 "$run_dir" "$run_dir/logs" 2>/dev/null || echo "warning: $run_dir is not this uid's: a root worker may not write in it" >&2
# One run per directory: a run of another release (here or in another namespace) would resume from this one's saves.
if [ -s "$run_dir/.owner" ] && [ "$(cat "$run_dir/.owner")" != "$owner" ]; then
  echo "error: run directory $run_dir belongs to run $(cat "$run_dir/.owner") (its .owner file), not $owner: give this run another run.name, or delete that file to take the directory over" >&2
  exit 1
fi
echo "$owner" > "$run_dir/.owner"
# This attempt's console, also on the claim: KubeRay deletes a failed attempt's submitter pod, and its log, to retry.
exec > >(tee -a "$run_dir/logs/attempt-$(date -u +%Y%m%dT%H%M%SZ).log") 2>&1
# While .running is fresh (this attempt touches it every 10 s), a Ray pod's preStop asks the run for a checkpoint
# (stop-requested) and waits for it; a .running left by a head that was killed goes stale, and no preStop waits on it.
rm -f "$run_dir/stop-requested"
touch "$run_dir/.running"
# (its output apart: its `sleep`, which outlives the kill below, would hold the console open for up to 10 s more)
( while sleep 10; do touch "$run_dir/.running"; done ) >/dev/null 2>&1 &
heartbeat=$!
trap 'kill $heartbeat 2>/dev/null; rm -f "$run_dir/.running"' EXIT
{{- if $limit }}
# rayJob.activeDeadlineSeconds holds for the whole run, from its first attempt (KubeRay's restarts at each retry).
left=$(python3 -m rl.launch deadline {{ .Release.Name }} --namespace {{ .Release.Namespace }} --limit {{ $limit }} --run-dir "$run_dir") || {
  echo "warning: the run's deadline could not be read from the Kubernetes API; this attempt gets {{ $limit }} s" >&2
  left={{ $limit }}
}
if [ "$left" -le 0 ]; then
  echo "error: the run's deadline (rayJob.activeDeadlineSeconds {{ $limit }} s from its first attempt) has passed" >&2
  exit 1
fi
{{- end }}
status=0
{{ if $limit }}timeout --signal=TERM --kill-after=60 "$left" {{ end }}{{ $train }} || status=$?
{{- if $export.uri }}
{{- if $export.checkpoints }}
# the newest complete checkpoint of this attempt, whatever its outcome
# (by the head's export container, which alone holds the export's credentials)
python3 -m engines.model.io.upload_service request "$run_dir/.exports" "$run_dir/checkpoints" {{ printf "%s/checkpoints" (trimSuffix "/" $export.uri) | squote }} --newest-checkpoint || echo "warning: the newest checkpoint was not uploaded (above); it stays on the claim" >&2
{{- end }}
if [ "$status" = 0 ]; then
  python3 -m engines.model.io.upload_service request "$run_dir/.exports" "$run_dir/final" {{ printf "%s/final" (trimSuffix "/" $export.uri) | squote }} || status=$?
fi
{{- end }}
{{- if $v.sandbox.enabled }}
if [ "$status" = 0 ]; then
  rl sandbox release {{ include "rl.fullname" . }}-sandbox --namespace {{ .Release.Namespace }} || echo "warning: the sandbox service was not released; rl delete {{ .Release.Name }} removes it"
fi
{{- end }}
exit "$status"
{{- end -}}
