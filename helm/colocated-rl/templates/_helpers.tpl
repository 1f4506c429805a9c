{{/* Names and labels shared by every template. */}}

{{- define "rl.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "rl.runName" -}}
{{- default .Release.Name .Values.run.name -}}
{{- end -}}

{{/* On every object of the run; rl delete finds what the run made (session pods included) by colocated-rl/run. */}}
{{- define "rl.labels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: colocated-rl
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
colocated-rl/run: {{ .Release.Name }}
{{- with .Values.scheduling.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "rl.annotations" -}}
{{- with .Values.scheduling.annotations }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* A Kubernetes quantity ("2Gi", "500M", "1.5G", "1024") in bytes. */}}
{{- define "rl.bytes" -}}
{{- $q := toString . -}}
{{- $n := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- $u := trimPrefix $n $q -}}
{{- if not (hasKey $units $u) }}{{ fail (printf "%q: not a memory quantity (e.g. 512Mi, 8Gi)" $q) }}{{ end -}}
{{- mulf (float64 $n) (get $units $u) | floor | int64 -}}
{{- end -}}

{{/* Ray's object store takes half of /dev/shm (the rest: the checkpoint engine's IPC buffers, torch), so it
     never falls back to disk; Ray's default (30% of the pod's memory) can exceed /dev/shm. */}}
{{- define "rl.objectStoreBytes" -}}
{{- div (include "rl.bytes" .) 2 -}}
{{- end -}}

{{/* Whole CPUs of a quantity ("4", "500m", "2.5"), at least 1: Ray's num-cpus. */}}
{{- define "rl.cpus" -}}
{{- $q := toString . -}}
{{- $n := ternary (divf (float64 (trimSuffix "m" $q)) 1000) (float64 $q) (hasSuffix "m" $q) -}}
{{- max 1 (floor $n | int) -}}
{{- end -}}

{{/* A CPU quantity ("2", "500m", "1.5") in millicores. */}}
{{- define "rl.millicores" -}}
{{- $q := toString . -}}
{{- ternary (trimSuffix "m" $q | float64) (mulf (float64 $q) 1000) (hasSuffix "m" $q) | floor | int64 -}}
{{- end -}}

{{/* A worker group's affinity: its own, plus (ReadWriteOnce storage) the head's node. */}}
{{- define "rl.workerAffinity" -}}
{{- $aff := deepCopy (.group.affinity | default dict) -}}
{{- if eq .root.Values.storage.accessMode "ReadWriteOnce" -}}
{{- $pa := get $aff "podAffinity" | default dict -}}
{{- $req := get $pa "requiredDuringSchedulingIgnoredDuringExecution" | default list -}}
{{- $head := dict "app.kubernetes.io/instance" .root.Release.Name "app.kubernetes.io/component" "ray-head" -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" $head) -}}
{{- $_ := set $pa "requiredDuringSchedulingIgnoredDuringExecution" (append $req $term) -}}
{{- $_ = set $aff "podAffinity" $pa -}}
{{- end -}}
{{- if .group.hostNetwork -}}{{/* Ray's fixed ports on the node's network: one such pod per node, of any run */}}
{{- $pa := get $aff "podAntiAffinity" | default dict -}}
{{- $req := get $pa "requiredDuringSchedulingIgnoredDuringExecution" | default list -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "namespaceSelector" dict "labelSelector" (dict "matchLabels" (dict "colocated-rl/host-network" "true")) -}}
{{- $_ := set $pa "requiredDuringSchedulingIgnoredDuringExecution" (append $req $term) -}}
{{- $_ = set $aff "podAntiAffinity" $pa -}}
{{- end -}}
{{- if $aff }}{{ toYaml $aff }}{{ end -}}
{{- end -}}

{{/* Scheduling fields every Ray pod and the submitter share. */}}
{{- define "rl.podScheduling" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (include "rl.runServiceAccount" .) }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.scheduling.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.scheduling.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end -}}

{{/* Annotations of every Ray pod: Karpenter and the cluster autoscaler leave its node alone while the run lives
     (a drain or consolidation would stop all of it), and scrape annotations for the given port. Called with root,
     port and disruptable (a disaggregated run's rollout pod: the run replaces it, so its node may go). */}}
{{- define "rl.rayPodAnnotations" -}}
{{- $v := .root.Values -}}
{{- if $v.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- if and $v.disruption.doNotDisrupt (not .disruptable) }}
karpenter.sh/do-not-disrupt: "true"
cluster-autoscaler.kubernetes.io/safe-to-evict: "false"
{{- end }}
{{- end -}}

{{/* Colocated workers one worker pod holds: its GPUs / run.gpusPerWorker (a tensor-parallel replica spans
     gpusPerWorker GPUs of one pod); a pod without GPUs holds one CPU worker. */}}
{{- define "rl.podWorkers" -}}
{{- $gpus := int .group.gpus -}}
{{- if gt $gpus 0 -}}
{{- $per := int .root.Values.run.gpusPerWorker -}}
{{- if mod $gpus $per -}}
{{- fail (printf "workerGroups[%s].gpus %d is not a multiple of run.gpusPerWorker %d: each colocated worker (a tensor-parallel replica) takes run.gpusPerWorker GPUs of one pod" .group.name $gpus $per) -}}
{{- end -}}
{{- div $gpus $per -}}
{{- else -}}
1
{{- end -}}
{{- end -}}

{{/* The JSON of --resources in rayStartParams, quoted for the shell command KubeRay builds: one rl_worker per
     colocated worker or trainer worker of the pod, one rl_rollout per replica of a rollout pod. */}}
{{- define "rl.workerSlots" -}}
{{- printf "\"{\\\"%s\\\": %s}\"" (ternary "rl_rollout" "rl_worker" (eq (.group.role | default "colocated") "rollout")) (include "rl.podWorkers" .) -}}
{{- end -}}

{{/* Whether the worker groups make a disaggregated run (roles trainer and rollout). */}}
{{- define "rl.disaggregated" -}}
{{- range .Values.workerGroups }}{{ if ne (.role | default "colocated") "colocated" }}true{{ end }}{{ end -}}
{{- end -}}

{{/* An image reference: repository@digest where a digest is given (the build itself, whatever its tag points at
     later), else repository:tag. Called with a dict of repository, tag, digest. */}}
{{- define "rl.imageRef" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{- define "rl.image" -}}
{{- include "rl.imageRef" .Values.image -}}
{{- end -}}

{{/* A worker group's image: its own (workerGroups[].image) or the run's. Called with root and group. */}}
{{- define "rl.groupImage" -}}
{{- $own := .group.image | default dict -}}
{{- if $own.repository -}}
{{- include "rl.imageRef" $own -}}
{{- else -}}
{{- include "rl.image" .root -}}
{{- end -}}
{{- end -}}

{{/* The image whose init container copies the sandbox agent into every session pod, and its pull policy: its own
     (sandbox.pods.agentImage) or the run's. */}}
{{- define "rl.agentImage" -}}
{{- $a := .Values.sandbox.pods.agentImage -}}
{{- if $a.repository -}}
{{- include "rl.imageRef" $a -}}
{{- else -}}
{{- include "rl.image" . -}}
{{- end -}}
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

{{/* The workers of the rollout pods (rollout true) or of the others (false), summed over their pods. Called with root
     and rollout. */}}
{{- define "rl.workersOf" -}}
{{- $n := 0 -}}
{{- range .root.Values.workerGroups -}}
{{- if eq (eq (.role | default "colocated") "rollout") $.rollout -}}
{{- $n = add $n (mul .replicas (include "rl.podWorkers" (dict "root" $.root "group" .) | int)) -}}
{{- end -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* The run's cluster.workers: colocated or trainer workers. */}}
{{- define "rl.loop.workers" -}}
{{- include "rl.workersOf" (dict "root" . "rollout" false) -}}
{{- end -}}

{{/* A disaggregated run's cluster.rollout_workers: the replicas of the rollout pods. */}}
{{- define "rl.rolloutWorkers" -}}
{{- include "rl.workersOf" (dict "root" . "rollout" true) -}}
{{- end -}}

{{/* GPUs of each colocated worker: run.gpusPerWorker where the run has GPU pods, else 0 (CPU workers). */}}
{{- define "rl.gpusPerWorker" -}}
{{- $g := 0 -}}
{{- range .Values.workerGroups -}}
{{- if gt (int .gpus) 0 }}{{ $g = int $.Values.run.gpusPerWorker }}{{ end -}}
{{- end -}}
{{- $g -}}
{{- end -}}

{{/* The run directory; a retried job finds its config.yaml there and resumes. */}}
{{- define "rl.runDir" -}}
{{- printf "%s/runs/%s" .Values.storage.mountPath (include "rl.runName" .) -}}
{{- end -}}

{{/* Where the model comes from: model.source (a hub id or a bucket; the head's init container downloads it into
     rl.modelCache, and the run resolves the same source there), else model.path, else the run config's. */}}
{{- define "rl.modelCache" -}}
{{- printf "%s/models" .Values.storage.mountPath -}}
{{- end -}}

{{- define "rl.trainArgs" -}}
{{- $tp := include "rl.gpusPerWorker" . | int -}}
{{- $args := list "--set" "cluster.ray_address=auto"
      "--set" (printf "cluster.workers=%s" (include "rl.loop.workers" .))
      "--set" (printf "cluster.gpus_per_worker=%d" $tp)
      "--set" (printf "metrics.prometheus_port=%v" .Values.run.metricsPort) -}}
{{- if include "rl.disaggregated" . -}}
{{- $args = concat $args (list "--set" "cluster.placement=disaggregated" "--set" (printf "cluster.rollout_workers=%s" (include "rl.rolloutWorkers" .))) -}}
{{- end -}}
{{- if gt $tp 1 -}}{{/* a replica spans its worker's GPUs: vLLM's tensor parallelism and the trainer's mesh */}}
{{- $args = concat $args (list "--set" (printf "rollout.tensor_parallel_size=%d" $tp)) -}}
{{- end -}}
{{- if and .Values.model.source .Values.model.path -}}
{{- fail (printf "model.source %q and model.path %q: set one (source downloads the model, path names a directory the pods see)" .Values.model.source .Values.model.path) -}}
{{- end -}}
{{- with (.Values.model.source | default .Values.model.path) -}}
{{- $args = concat $args (list "--set" (printf "model.path=%s" .)) -}}
{{- end -}}
{{- if .Values.sandbox.enabled -}}
{{- $args = concat $args (list "--set" (printf "sandbox.address=%s" (include "rl.sandboxAddress" .))) -}}
{{- end -}}
{{- $args = concat $args .Values.run.extraArgs -}}
{{- range $args }} {{ . | squote }}{{ end -}}
{{- end -}}

{{/* The environment of every Ray pod: the warm-start cache on the run's volume, which every Ray pod mounts,
     so the workers find the model the head warm-starts; the downloaded models' cache; the sandbox's token; then
     run.env and the pod group's own env (NCCL_* and the like). Called with root and env. */}}
{{- define "rl.rayEnv" -}}
{{- $v := .root.Values -}}
- name: RL_CACHE_DIR
  value: {{ printf "%s/cache" $v.storage.mountPath | quote }}
- name: RL_WORKER_SLOTS  # place workers by the pods' slots, also while worker pods are still joining
  value: {{ ternary "rl_worker,rl_rollout" "rl_worker" (not (empty (include "rl.disaggregated" .root))) | quote }}
- name: RL_RUN_UMASK  # what a root RDMA worker and the uid-1000 pods write in the run directory stays group-writable
  value: "0002"
{{- if $v.logging.rayToStderr }}
- name: RAY_LOG_TO_STDERR  # Ray's own logs to the container's stderr: the cluster's log collector ships them
  value: "1"
{{- end }}
{{- if $v.model.source }}
- name: RL_MODEL_CACHE  # the head's init container downloaded model.source here
  value: {{ include "rl.modelCache" .root | quote }}
{{- end }}
{{- if $v.sandbox.enabled }}
- name: RL_SANDBOX_TOKEN  # the sandbox service admits only calls that carry it
  valueFrom: {secretKeyRef: {name: {{ $v.sandbox.tokenSecret | default (include "rl.sandboxTokenSecret" .root) }}, key: token}}
{{- end }}
{{- with $v.run.env }}
{{ toYaml . }}
{{- end }}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod Security Standards (restricted) for every pod of the run: a non-root uid (the image's, 1000), the
     runtime's default seccomp filter; fsGroup lets it write the run storage, and OnRootMismatch keeps kubelet from
     chowning a large shared volume at every pod start. */}}
{{- define "rl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
fsGroupChangePolicy: OnRootMismatch
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* A container's: no privilege gain, every capability dropped but those given (e.g. IPC_LOCK for RDMA). */}}
{{- define "rl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
  {{- with . }}
  add: {{ toJson . }}
  {{- end }}
{{- end -}}

{{/* The labels the service puts on its session pods (and owner leases): the run's name and namespace. */}}
{{- define "rl.sessionLabels" -}}
colocated-rl/run: {{ .Release.Name }}
colocated-rl/run-namespace: {{ .Release.Namespace }}
{{- end -}}

{{- define "rl.sandboxTokenSecret" -}}
{{- printf "%s-sandbox-token" (include "rl.fullname" .) -}}
{{- end -}}

{{/* The namespace of the sandbox's session pods: never the run's own (its pods, claims and Secrets). */}}
{{- define "rl.sessionNamespace" -}}
{{- $default := printf "%s-%s-sandbox" .Release.Namespace (include "rl.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- $ns := .Values.sandbox.sessionNamespace.name | default $default -}}
{{- if eq $ns .Release.Namespace -}}
{{- fail (printf "sandbox.sessionNamespace.name %q is the run's own namespace: session pods run untrusted code, and the service's right to make pods must not reach the Ray pods, the run's claim or its Secrets; name another namespace" $ns) -}}
{{- end -}}
{{- $ns -}}
{{- end -}}

{{/* The run's Ray pods (head, workers, submitter): not the sandbox's, whose session pods carry the run label too. */}}
{{- define "rl.rayPeers" -}}
podSelector:
  matchLabels:
    colocated-rl/run: {{ .Release.Name }}
  matchExpressions:
    - {key: app.kubernetes.io/component, operator: In, values: [ray-head, ray-worker, ray-submitter]}
{{- end -}}

{{/* A NetworkPolicy peer: the run's head, submitter and worker pods less the rollout pods (roles NotIn), or its rollout
     pods alone (roles In). Called with root and roles. */}}
{{- define "rl.runPods" -}}
podSelector:
  matchLabels:
    colocated-rl/run: {{ .root.Release.Name }}
  matchExpressions:
    {{- if eq .roles "In" }}
    - {key: app.kubernetes.io/component, operator: In, values: [ray-worker]}
    {{- else }}
    - {key: app.kubernetes.io/component, operator: In, values: [ray-head, ray-worker, ray-submitter]}
    {{- end }}
    - {key: colocated-rl/role, operator: {{ .roles }}, values: [rollout]}
{{- end -}}

{{/* The ports a disaggregated run's weight transfer listens on: the trainer and rollout pods' ephemeral range. */}}
{{- define "rl.transferPorts" -}}
- {protocol: TCP, port: {{ int .Values.weightTransfer.ports.first }}, endPort: {{ int .Values.weightTransfer.ports.last }}}
{{- end -}}

{{/* Whether a worker group uses the node's network. */}}
{{- define "rl.hostNetwork" -}}
{{- $any := false -}}
{{- range .Values.workerGroups }}{{ if .hostNetwork }}{{ $any = true }}{{ end }}{{ end -}}
{{- if $any }}true{{ end -}}
{{- end -}}

{{/* Ray's internal ports, pinned in every pod's rayStartParams so that the nodes' addresses (hostNetwork workers)
     can be admitted to them and to nothing else: GCS, raylet and object manager; the workers' (and driver's) range. */}}
{{- define "rl.rayInternalPorts" -}}
- {protocol: TCP, port: 6379, endPort: 6381}
- {protocol: TCP, port: 10002, endPort: 19999}
{{- end -}}

{{/* The same in rayStartParams (the head's GCS is 6379 by default). */}}
{{- define "rl.rayPortParams" -}}
node-manager-port: "6380"
object-manager-port: "6381"
min-worker-port: "10002"
max-worker-port: "19999"
{{- end -}}

{{/* A rule's `from` (or `to`) items for the nodes' addresses, where hostNetwork workers' traffic comes from. */}}
{{- define "rl.nodePeers" -}}
{{- range .Values.networkPolicy.nodeCIDRs }}
- ipBlock: {cidr: {{ . }}}
{{- end }}
{{- end -}}

{{/* An ingress rule admitting metrics.scrapeFrom to the given ports; none where it is empty (the ports stay closed:
     an empty `from` would admit every source). Called with root and ports. */}}
{{- define "rl.metricsIngress" -}}
{{- with .root.Values.metrics.scrapeFrom }}
- from:
    {{- toYaml . | nindent 4 }}
  ports:
    {{- range $.ports }}
    - {protocol: TCP, port: {{ . }}}
    {{- end }}
{{- end }}
{{- end -}}

{{/* "true" where rayJob.rayVersion has token authentication (2.52 or newer). */}}
{{- define "rl.rayHasTokenAuth" -}}
{{- $ray := regexFind `^[0-9]+\.[0-9]+(\.[0-9]+)?` (.Values.rayJob.rayVersion | default "") -}}
{{- if and $ray (semverCompare ">=2.52.0" $ray) }}true{{ end -}}
{{- end -}}

{{/* "true" where Ray's token authentication is on: rayJob.authToken, or where that is null, the Ray version's. */}}
{{- define "rl.authToken" -}}
{{- $t := .Values.rayJob.authToken -}}
{{- if kindIs "bool" $t -}}
{{- if $t }}true{{ end -}}
{{- else -}}
{{- include "rl.rayHasTokenAuth" . -}}
{{- end -}}
{{- end -}}

{{/* Volumes every Ray pod mounts: the run config, the run storage, /dev/shm, the model claim. */}}
{{- define "rl.rayVolumes" -}}
- name: run-config
  configMap:
    name: {{ include "rl.configName" .root }}
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

{{/* A worker group's GPUs and extra resources (RDMA devices, EFA interfaces): requested and limited alike. */}}
{{- define "rl.extendedResources" -}}
{{- if gt (int .gpus) 0 }}
{{ .gpuResource | default "nvidia.com/gpu" }}: {{ .gpus | quote }}
{{- end }}
{{- range $name, $n := .extraResources }}
{{ $name }}: {{ $n | toString | quote }}
{{- end }}
{{- end -}}

{{/* An egress rule to the cluster's DNS (networkPolicy.egress). */}}
{{- define "rl.dnsEgress" -}}
{{- $eg := .Values.networkPolicy.egress -}}
to:
  - namespaceSelector:
      matchLabels:
        {{- toYaml $eg.dnsNamespaceLabels | nindent 8 }}
    podSelector:
      matchLabels:
        {{- toYaml $eg.dnsPodLabels | nindent 8 }}
ports:
  - {protocol: UDP, port: 53}
  - {protocol: TCP, port: 53}
{{- end -}}

{{/* The Ray pods' and the submitter's service account: the one named in scheduling.serviceAccountName, else, with a
     sandbox, the chart's own (its only right: scaling the sandbox's Deployment at the run's end), else none (the
     namespace's default). */}}
{{- define "rl.runServiceAccount" -}}
{{- if .Values.scheduling.serviceAccountName -}}
{{- .Values.scheduling.serviceAccountName -}}
{{- else if or .Values.sandbox.enabled (gt (int .Values.rayJob.activeDeadlineSeconds) 0) -}}
{{- printf "%s-run" (include "rl.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* A list of strings as CEL string literals, comma-separated (backslashes and quotes escaped). */}}
{{- define "rl.celStrings" -}}
{{- $out := list -}}
{{- range . }}{{ $out = append $out (printf "'%s'" (. | replace "\\" "\\\\" | replace "'" "\\'")) }}{{ end -}}
{{- join ", " $out -}}
{{- end -}}
