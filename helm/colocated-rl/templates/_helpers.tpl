{{/* Names and labels shared by every template. */}}

{{- define "rl.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* KubeRay names the Ray cluster's Services after the RayJob: a DNS-1035 label (a letter first). */}}
{{- define "rl.checkName" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" .Release.Name) -}}
{{- fail (printf "release name %q: must start with a lower-case letter and hold only a-z, 0-9 and '-' (KubeRay names the RayJob's Services after it, and Service names are DNS-1035 labels); rl launch --name NAME picks another" .Release.Name) -}}
{{- end -}}
{{- if gt (len .Release.Name) 40 -}}
{{- fail (printf "release name %q: at most 40 characters (KubeRay adds suffixes to the RayJob's name)" .Release.Name) -}}
{{- end -}}
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

{{/* /dev/shm is memory-backed and counts against the pod's memory limit. */}}
{{- define "rl.checkShm" -}}
{{- if ge (include "rl.bytes" .shm | int64) (include "rl.bytes" .memory | int64) -}}
{{- fail (printf "%s.shmSize %s must be less than %s.memory %s: /dev/shm is memory-backed and counts against the pod's memory limit" .where .shm .where .memory) -}}
{{- end -}}
{{- end -}}

{{/* ReadWriteOnce storage is attached to one node: every Ray pod must be able to go to the head's, and one node
     holds at most one GPU pod's worth of GPUs (the head itself is a CPU pod and may land on a CPU node). */}}
{{- define "rl.checkStorage" -}}
{{- if eq .Values.storage.accessMode "ReadWriteOnce" -}}
{{- $gpuPods := 0 -}}
{{- range .Values.workerGroups -}}
{{- if gt (int .gpus) 0 }}{{ $gpuPods = add $gpuPods .replicas }}{{ end -}}
{{- end -}}
{{- if gt (int $gpuPods) 1 -}}
{{- fail (printf "storage.accessMode ReadWriteOnce attaches the run volume to one node, so all %d GPU worker pods would have to share the head's node and all but one stay Pending: set storage.accessMode=ReadWriteMany with a storageClassName (or existingClaim) that offers it (NFS, EFS, Filestore, Azure Files, CephFS, Lustre)" (int $gpuPods)) -}}
{{- end -}}
{{- range $i, $g := .Values.workerGroups -}}
{{- range $t := $g.tolerations -}}
{{- if not (has $t ($.Values.head.tolerations | default list)) -}}
{{- fail (printf "storage.accessMode ReadWriteOnce puts every Ray pod on the head's node (the volume attaches to one node), but workerGroups[%d] tolerates the taint %s and the head does not: the head stays off those nodes and the worker Pending. Give head.tolerations (and head.nodeSelector) the group's, so the head goes to its node, or set storage.accessMode=ReadWriteMany" $i (toJson $t)) -}}
{{- end -}}
{{- end -}}
{{- if not (deepEqual ($g.nodeSelector | default dict) ($.Values.head.nodeSelector | default dict)) -}}
{{- fail (printf "storage.accessMode ReadWriteOnce puts every Ray pod on the head's node (the volume attaches to one node), but workerGroups[%d].nodeSelector %s differs from head.nodeSelector %s: set storage.accessMode=ReadWriteMany with a storage class or existingClaim that offers it (NFS, EFS, Filestore, Azure Files, CephFS)" $i (toJson ($g.nodeSelector | default dict)) (toJson ($.Values.head.nodeSelector | default dict))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
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
     (a drain or consolidation would stop all of it), and scrape annotations for the given port. Called with root
     and port. */}}
{{- define "rl.rayPodAnnotations" -}}
{{- $v := .root.Values -}}
{{- if $v.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- if $v.disruption.doNotDisrupt }}
karpenter.sh/do-not-disrupt: "true"
cluster-autoscaler.kubernetes.io/safe-to-evict: "false"
{{- end }}
{{- end -}}

{{/* A Ray pod's preStop: on SIGTERM while the run lives (launch.sh's <run dir>/.running), ask the run for a checkpoint
     (<run dir>/stop-requested) and wait until it answers by removing the file, the run ends, or the grace period
     (less 10 s) is spent. */}}
{{- define "rl.preStop" -}}
{{- $dir := include "rl.runDir" . -}}
{{- $wait := sub (int .Values.disruption.terminationGracePeriodSeconds) 10 -}}
preStop:
  exec:
    command:
      - sh
      - -c
      - {{ printf `d=%s; [ -e "$d/.running" ] || exit 0; echo "$(hostname) $(date +%%s)" >> "$d/stop-requested"; t=0; while [ -e "$d/stop-requested" ] && [ -e "$d/.running" ] && [ $t -lt %d ]; do sleep 1; t=$((t+1)); done` ($dir | squote) $wait | quote }}
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

{{/* The JSON of --resources in rayStartParams, quoted for the shell command KubeRay builds. */}}
{{- define "rl.workerSlots" -}}
{{- printf "\"{\\\"rl_worker\\\": %s}\"" (include "rl.podWorkers" .) -}}
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


{{/* Values that render but cannot work, or are unsafe: refused here, naming the value and the fix. */}}
{{- define "rl.checkValues" -}}
{{- $v := .Values -}}
{{- if and (eq $v.image.pullPolicy "Always") (not $v.image.digest) -}}
{{- fail (printf "image.pullPolicy Always with tag %q and no image.digest: each pod of the run, its retries and the sandbox pull whatever the tag points at when they start, so one run can mix builds; set image.digest to the build's (sha256:..., docker push prints it), or pullPolicy IfNotPresent with a tag you never reuse" $v.image.tag) -}}
{{- end -}}
{{- $a := $v.sandbox.pods.agentImage -}}
{{- if and $a.repository (not (or $a.tag $a.digest)) -}}
{{- fail "sandbox.pods.agentImage.repository needs a tag or a digest" -}}
{{- end -}}
{{- $np := $v.head.networkPolicy -}}
{{- if and $np.enabled $np.dashboardCIDRs (not $v.rayJob.authToken) -}}
{{- fail (printf "head.networkPolicy.dashboardCIDRs %s opens the Ray dashboard and Jobs API (8265: it runs any code it is sent, with the run's GPUs and tokens) to those addresses without authentication: set rayJob.authToken=true (KubeRay >= 1.6, Ray >= 2.52), or drop them and use kubectl port-forward" (toJson $np.dashboardCIDRs)) -}}
{{- end -}}
{{- if $v.rayJob.authToken -}}
{{- $ray := regexFind `^[0-9]+\.[0-9]+(\.[0-9]+)?` ($v.rayJob.rayVersion | default "") -}}
{{- if or (not $ray) (semverCompare "<2.52.0" $ray) -}}
{{- fail (printf "rayJob.authToken needs rayJob.rayVersion 2.52.0 or newer (KubeRay refuses token authentication otherwise), got %q" $v.rayJob.rayVersion) -}}
{{- end -}}
{{- end -}}
{{- $policies := or $np.enabled $v.networkPolicy.workers $v.networkPolicy.egress.enabled -}}
{{- range $i, $g := $v.workerGroups -}}
{{- if and $g.hostNetwork $policies (not $v.networkPolicy.nodeCIDRs) -}}
{{- fail (printf "workerGroups[%d].hostNetwork: its traffic comes from the node's address, which the chart's NetworkPolicies (pod selectors) do not admit, so it could not reach the head or the other workers: set networkPolicy.nodeCIDRs to the nodes' addresses (e.g. [10.0.0.0/16]), or turn hostNetwork off" $i) -}}
{{- end -}}
{{- if and $g.capabilities (ne ($g.memlock | default "") "root") -}}
{{- fail (printf "workerGroups[%d].capabilities %s: a capability added to a container is lost at the first execve of a non-root process (kubernetes#56374), and the workers run as uid 1000, so it would only put the pod at the privileged level; for RDMA set workerGroups[%d].memlock=node (the nodes' runtime gives RLIMIT_MEMLOCK unlimited: no capability needed) or memlock=root (the worker runs as root, keeping IPC_LOCK)" $i (toJson $g.capabilities) $i) -}}
{{- end -}}
{{- end -}}
{{- if and $v.networkPolicy.egress.enabled (not $v.networkPolicy.egress.apiServerCIDRs) -}}
{{- fail "networkPolicy.egress.enabled: networkPolicy.egress.apiServerCIDRs must name the API server's addresses (kubectl get endpoints kubernetes -n default): the head reaches it (rl sandbox release, the run's deadline) and so does the sandbox service (session pods)" -}}
{{- end -}}
{{- if and $v.scheduling.queueName (not $v.rayJob.shutdownAfterJobFinishes) -}}
{{- fail (printf "scheduling.queueName %q: Kueue admits a RayJob by suspending and resuming it, and KubeRay refuses to suspend one with rayJob.shutdownAfterJobFinishes false" $v.scheduling.queueName) -}}
{{- end -}}
{{- if and $v.sandbox.enabled (eq $v.sandbox.backend "kubernetes") (not $a.repository) -}}
{{- range $v.workerGroups -}}
{{- if gt (int .gpus) 0 -}}
{{- fail (printf "sandbox.pods.agentImage: every session pod's init container pulls it to copy the sandbox agent, and by default it is the run's image %s, a GPU run's several-GB CUDA build: build docker/Dockerfile.agent (the sandbox package on python:3.12-slim) and set sandbox.pods.agentImage.repository and .tag (or .digest)" (include "rl.image" $)) -}}
{{- end -}}
{{- end -}}
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

{{/* Colocated workers of the run: the sum over the worker pods. */}}
{{- define "rl.workers" -}}
{{- $n := 0 -}}
{{- range .Values.workerGroups -}}
{{- $n = add $n (mul .replicas (include "rl.podWorkers" (dict "root" $ "group" .) | int)) -}}
{{- end -}}
{{- $n -}}
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
      "--set" (printf "cluster.workers=%s" (include "rl.workers" .))
      "--set" (printf "cluster.gpus_per_worker=%d" $tp)
      "--set" (printf "metrics.prometheus_port=%v" .Values.run.metricsPort) -}}
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
- name: RL_WORKER_SLOTS  # place workers by the pods' rl_worker slots, also while worker pods are still joining
  value: "1"
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

{{/* Whether a worker group uses the node's network. */}}
{{- define "rl.hostNetwork" -}}
{{- $any := false -}}
{{- range .Values.workerGroups }}{{ if .hostNetwork }}{{ $any = true }}{{ end }}{{ end -}}
{{- if $any }}true{{ end -}}
{{- end -}}

{{/* A rule's `from` (or `to`) items for the nodes' addresses, where hostNetwork workers' traffic comes from. */}}
{{- define "rl.nodePeers" -}}
{{- range .Values.networkPolicy.nodeCIDRs }}
- ipBlock: {cidr: {{ . }}}
{{- end }}
{{- end -}}

{{/* An ingress rule admitting metrics.scrapeFrom (any source where empty) to the given ports. Called with root and
     ports. */}}
{{- define "rl.metricsIngress" -}}
- ports:
    {{- range .ports }}
    - {protocol: TCP, port: {{ . }}}
    {{- end }}
  {{- with .root.Values.metrics.scrapeFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
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
{{- $creds := ternary " --credentials-dir /var/run/rl-export" "" (not (empty $v.model.credentialsSecret)) -}}
{{- $train := printf "rl train %s --run-dir \"$run_dir\" --auto-resume%s" (printf "%s/config.yaml" $v.run.configMountPath | squote) (include "rl.trainArgs" .) -}}
set -e
run_dir={{ include "rl.runDir" . | squote }}
owner={{ printf "%s/%s" .Release.Namespace .Release.Name | squote }}
mkdir -p "$run_dir/logs"
# One run per directory: a run of another release (here or in another namespace) would resume from this one's saves.
if [ -s "$run_dir/.owner" ] && [ "$(cat "$run_dir/.owner")" != "$owner" ]; then
  echo "error: run directory $run_dir belongs to run $(cat "$run_dir/.owner") (its .owner file), not $owner: give this run another run.name, or delete that file to take the directory over" >&2
  exit 1
fi
echo "$owner" > "$run_dir/.owner"
# This attempt's console, also on the claim: KubeRay deletes a failed attempt's submitter pod, and its log, to retry.
exec > >(tee -a "$run_dir/logs/attempt-$(date -u +%Y%m%dT%H%M%SZ).log") 2>&1
# While .running exists, a Ray pod's preStop asks the run for a checkpoint (stop-requested) and waits for it.
rm -f "$run_dir/stop-requested"
touch "$run_dir/.running"
trap 'rm -f "$run_dir/.running"' EXIT
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
python3 -m engines.model.uploads --newest-checkpoint "$run_dir/checkpoints" {{ printf "%s/checkpoints" (trimSuffix "/" $export.uri) | squote }}{{ $creds }} || echo "warning: the newest checkpoint was not uploaded (above); it stays on the claim" >&2
{{- end }}
if [ "$status" = 0 ]; then
  python3 -m engines.model.uploads "$run_dir/final" {{ printf "%s/final" (trimSuffix "/" $export.uri) | squote }}{{ $creds }} || status=$?
fi
{{- end }}
{{- if $v.sandbox.enabled }}
if [ "$status" = 0 ]; then
  rl sandbox release {{ include "rl.fullname" . }}-sandbox --namespace {{ .Release.Namespace }} || echo "warning: the sandbox service was not released; rl delete {{ .Release.Name }} removes it"
fi
{{- end }}
exit "$status"
{{- end -}}
