{{/* Values that cannot work or are unsafe, refused at render time naming the value and the fix (rayjob.yaml calls them). */}}

{{/* KubeRay names the Ray cluster's Services after the RayJob: a DNS-1035 label (a letter first). */}}
{{- define "rl.checkName" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" .Release.Name) -}}
{{- fail (printf "release name %q: must start with a lower-case letter and hold only a-z, 0-9 and '-' (KubeRay names the RayJob's Services after it, and Service names are DNS-1035 labels); rl launch --name NAME picks another" .Release.Name) -}}
{{- end -}}
{{- if gt (len .Release.Name) 40 -}}
{{- fail (printf "release name %q: at most 40 characters (KubeRay adds suffixes to the RayJob's name)" .Release.Name) -}}
{{- end -}}
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
{{- $auth := include "rl.authToken" . -}}
{{- if and $np.enabled $np.dashboardCIDRs (not $auth) -}}
{{- fail (printf "head.networkPolicy.dashboardCIDRs %s opens the Ray dashboard and Jobs API (8265: it runs any code it is sent, with the run's GPUs and tokens) to those addresses without authentication: set rayJob.authToken=true (KubeRay >= 1.6, Ray >= 2.52), or drop them and use kubectl port-forward" (toJson $np.dashboardCIDRs)) -}}
{{- end -}}
{{- if and (not $np.enabled) (not $auth) -}}
{{- fail "head.networkPolicy.enabled=false with Ray's token authentication off: nothing would stand between the Jobs API (8265: it runs any code it is sent, with the run's GPUs and tokens) and whoever reaches the head; set rayJob.authToken=true with rayJob.rayVersion 2.52.0 or newer (KubeRay >= 1.6), or keep the policy on" -}}
{{- end -}}
{{- if and $auth (not (include "rl.rayHasTokenAuth" .)) -}}
{{- fail (printf "rayJob.authToken needs rayJob.rayVersion 2.52.0 or newer (KubeRay refuses token authentication otherwise), got %q" $v.rayJob.rayVersion) -}}
{{- end -}}
{{- if and $v.storage.export.uri $v.model.credentialsSecret (not $v.storage.export.credentialsSecret) -}}
{{- fail (printf "storage.export.uri %s takes its credentials from storage.export.credentialsSecret (keys that may write to the bucket and nothing else), no longer from model.credentialsSecret %s (the download's, readable wherever the model is fetched): name the export's own Secret, or leave both to the pods' identity by removing model.credentialsSecret" $v.storage.export.uri $v.model.credentialsSecret) -}}
{{- end -}}
{{- $rate := float64 ($v.disruption.saveGBps | default 0) -}}
{{- $params := float64 ($v.model.parametersBillions | default 0) -}}
{{- if and (gt $rate 0.0) (gt $params 0.0) -}}
{{- $save := ceil (divf (mulf $params 11.0) $rate) | int -}}
{{- $left := sub (int $v.disruption.terminationGracePeriodSeconds) 10 -}}
{{- if lt $left (add $save 30) -}}
{{- fail (printf "disruption.terminationGracePeriodSeconds %d leaves %d s for the checkpoint a stopped pod asks for, but one of %gB parameters (about %.0f GB, 11 bytes per parameter) at disruption.saveGBps %g takes about %d s: set terminationGracePeriodSeconds to at least %d plus a training phase's time" (int $v.disruption.terminationGracePeriodSeconds) $left $params (mulf $params 11.0) $rate $save (add $save 40)) -}}
{{- end -}}
{{- end -}}
{{- $gpuGroups := list -}}{{- $cpuGroups := list -}}
{{- range $i, $g := $v.workerGroups -}}
{{- if gt (int $g.gpus) 0 }}{{ $gpuGroups = append $gpuGroups $g.name }}{{ else }}{{ $cpuGroups = append $cpuGroups $g.name }}{{ end -}}
{{- end -}}
{{- if and $gpuGroups $cpuGroups -}}
{{- fail (printf "workerGroups mix GPU groups %s and CPU groups %s: the run makes every worker one of run.gpusPerWorker GPUs (cluster.gpus_per_worker, one for both roles of a disaggregated run), so it would ask for a GPU bundle per CPU worker too and never be placed; give every group GPUs, or drop the CPU groups" (toJson $gpuGroups) (toJson $cpuGroups)) -}}
{{- end -}}
{{- include "rl.checkRoles" . -}}
{{- $policies := or $np.enabled $v.networkPolicy.workers $v.networkPolicy.egress.enabled -}}
{{- range $i, $g := $v.workerGroups -}}
{{- if and $g.hostNetwork $policies (not $v.networkPolicy.nodeCIDRs) -}}
{{- fail (printf "workerGroups[%d].hostNetwork: its traffic comes from the node's address, which the chart's NetworkPolicies (pod selectors) do not admit, so it could not reach the head or the other workers: set networkPolicy.nodeCIDRs to the nodes' addresses (e.g. [10.0.0.0/16]), or turn hostNetwork off" $i) -}}
{{- end -}}
{{- if and $g.hostNetwork (not $auth) -}}
{{- fail (printf "workerGroups[%d].hostNetwork: a pod on the node's network is outside every NetworkPolicy, so its Ray ports (GCS, and the dashboard agent on 52365, which takes job submissions) are open to anything that reaches the node: set rayJob.authToken=true with rayJob.rayVersion 2.52.0 or newer (KubeRay >= 1.6), or turn hostNetwork off" $i) -}}
{{- end -}}
{{- if and (eq ($g.memlock | default "") "root") (not (has "IPC_LOCK" ($g.capabilities | default list))) -}}
{{- fail (printf "workerGroups[%d].memlock root: the worker runs as root only to keep IPC_LOCK (to pin NCCL's RDMA buffers), which is dropped with every other capability unless given: set workerGroups[%d].capabilities=[IPC_LOCK], or memlock=node where the nodes' runtime gives an unlimited RLIMIT_MEMLOCK" $i $i) -}}
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

{{/* A disaggregated run (workerGroups[].role): both sides and nothing colocated beside them, on the fabric the weight
     transfer uses, with ports the kernel can hand out and no Ray port among them; a group's own image is pinned. */}}
{{- define "rl.checkRoles" -}}
{{- $v := .Values -}}
{{- $roles := dict -}}
{{- range $i, $g := $v.workerGroups -}}
{{- $_ := set $roles ($g.role | default "colocated") $g.name -}}
{{- $own := $g.image | default dict -}}
{{- if and $own.repository (not (or $own.tag $own.digest)) -}}
{{- fail (printf "workerGroups[%d].image.repository %s needs a tag or a digest" $i $own.repository) -}}
{{- end -}}
{{- if and (or $own.tag $own.digest) (not $own.repository) -}}
{{- fail (printf "workerGroups[%d].image: a tag or digest without a repository (give repository too, or leave image empty for the run's)" $i) -}}
{{- end -}}
{{- end -}}
{{- if include "rl.disaggregated" . -}}
{{- if hasKey $roles "colocated" -}}
{{- fail (printf "workerGroups[%s] is colocated beside trainer and rollout groups: a run is colocated (every worker a trainer rank and a replica) or disaggregated (trainer pods and rollout pods), not both; give that group role trainer or rollout" (get $roles "colocated")) -}}
{{- end -}}
{{- range $need := list "trainer" "rollout" -}}
{{- if not (hasKey $roles $need) -}}
{{- fail (printf "workerGroups: a disaggregated run needs a group of role %s too (trainer pods train, rollout pods generate)" $need) -}}
{{- end -}}
{{- end -}}
{{- $w := $v.weightTransfer -}}
{{- range $i, $g := $v.workerGroups -}}
{{- if $g.hostNetwork -}}
{{- fail (printf "workerGroups[%d].hostNetwork with role %s: weightTransfer.fabric is pod (the gloo transfer on the pod network, its ports pinned by a per-pod sysctl, which a pod on the node's network cannot set), the only fabric built; turn hostNetwork off" $i $g.role) -}}
{{- end -}}
{{- end -}}
{{- $first := int $w.ports.first -}}{{- $last := int $w.ports.last -}}
{{- if lt (sub $last $first) 1023 -}}
{{- fail (printf "weightTransfer.ports %d-%d: the trainer and rollout pods' ephemeral range (their outgoing connections draw from it too) needs at least 1024 ports" $first $last) -}}
{{- end -}}
{{- range $r := list (list 6379 6381) (list 8265 8265) (list 10001 19999) (list 52365 52365) (list (int $v.metrics.rayPort) (int $v.metrics.rayPort)) -}}
{{- if and (le $first (index $r 1)) (ge $last (index $r 0)) -}}
{{- fail (printf "weightTransfer.ports %d-%d overlaps Ray's ports %d-%d (GCS, raylet, object manager 6379-6381, Jobs API 8265, client 10001, workers 10002-19999, dashboard agent 52365, metrics): pick a range outside them, e.g. 20000-29999" $first $last (index $r 0) (index $r 1)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
