{{/*
Names, labels and the pieces every pod of the chart shares. Ports, flags and environment
variables are the pdserve command line's (docs/operations/); the chart never
puts a secret on a command line or into an env value: secrets reach processes as mounted
files or through `valueFrom.secretKeyRef`.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* RELEASE-pdserve, or RELEASE alone when it already contains the chart name. Kept to
42 characters so that "-router-metrics" and friends still fit a 63-character name. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 42 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects: (dict "root" $ "component" "router") */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The pdserve image of one component: (dict "root" $ "component" "router").
An explicit image.tag (or digest) is used by every component; otherwise the router and the
planner (torch never runs there) take APPVERSION-cpu and the workers APPVERSION-cuda when
gpu.enabled. */}}
{{- define "pdserve.image" -}}
{{- $image := .root.Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else if $image.tag -}}
{{- printf "%s:%s" $image.repository $image.tag -}}
{{- else -}}
{{- $variant := ternary "cuda" "cpu" (and .root.Values.gpu.enabled (not (has .component (list "router" "planner")))) -}}
{{- printf "%s:%s-%s" $image.repository .root.Chart.AppVersion $variant -}}
{{- end -}}
{{- end -}}

{{/* "true" in the pooled layout (workers.layout=pooled), else "": one worker StatefulSet
whose roles are runtime state, in place of the prefill Deployment and decode StatefulSet. */}}
{{- define "pdserve.pooled" -}}
{{- if eq .Values.workers.layout "pooled" -}}true{{- end -}}
{{- end -}}

{{/* "true" when the planner runs: the pooled layout with planner.enabled, else "". */}}
{{- define "pdserve.plannerEnabled" -}}
{{- if and (include "pdserve.pooled" .) .Values.planner.enabled -}}true{{- end -}}
{{- end -}}

{{/* The worker components of the layout, space-separated: "prefill decode" or "pool"
(each is also its values key); `splitList " "` makes them a list. */}}
{{- define "pdserve.workerComponents" -}}
{{- ternary "pool" "prefill decode" (eq .Values.workers.layout "pooled") -}}
{{- end -}}

{{/* The Redis key namespace (pdserve --cluster) shared by the router and the workers. */}}
{{- define "pdserve.clusterKey" -}}
{{- default (include "pdserve.fullname" .) .Values.redis.keyNamespace -}}
{{- end -}}

{{- define "pdserve.redisServiceName" -}}
{{- printf "%s-redis" (include "pdserve.fullname" .) -}}
{{- end -}}

{{/* The Secret and key holding the Redis password; empty name: no password (external Redis
without auth). */}}
{{- define "pdserve.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{- default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.passwordSecret.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisSecretKey" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.secretKey -}}
{{- else -}}
{{- .Values.redis.external.passwordSecret.key -}}
{{- end -}}
{{- end -}}

{{/* The environment that gives a pdserve process its Redis: REDIS_PASSWORD from the Secret,
then PDSERVE_REDIS_URL built from it by Kubernetes' $(VAR) expansion, so the password is
in neither the pod spec nor a command line. */}}
{{- define "pdserve.redisEnv" -}}
{{- $secret := include "pdserve.redisSecretName" . -}}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "pdserve.redisSecretKey" . }}
{{- end }}
{{- if .Values.redis.enabled }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "pdserve.redisServiceName" .) (int .Values.redis.port) | quote }}
{{- else }}
{{- $ext := .Values.redis.external -}}
{{- $auth := "" -}}
{{- if $secret -}}
{{- $auth = printf "%s:$(REDIS_PASSWORD)@" $ext.username -}}
{{- end }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "%s://%s%s:%d/%d" (ternary "rediss" "redis" $ext.tls) $auth $ext.host (int $ext.port) (int $ext.db) | quote }}
{{- end }}
{{- end -}}

{{/* The Secret holding the cluster token (the internal plane's shared secret): the user's
clusterToken.existingSecret, else the one this chart generates (cluster-token-secret.yaml). */}}
{{- define "pdserve.clusterTokenSecretName" -}}
{{- default (printf "%s-cluster-token" (include "pdserve.fullname" .)) .Values.clusterToken.existingSecret -}}
{{- end -}}

{{/* The environment that gives a router, worker or planner the cluster token:
$PDSERVE_CLUSTER_TOKEN from the Secret (a required reference: a pod whose Secret or key is
missing does not start, rather than run with an open internal plane). Nothing when
clusterToken.enabled=false. */}}
{{- define "pdserve.clusterTokenEnv" -}}
{{- if .Values.clusterToken.enabled }}
- name: PDSERVE_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.clusterTokenSecretName" . }}
      key: {{ .Values.clusterToken.secretKey }}
{{- end }}
{{- end -}}

{{/* --model: the checkpoint directory inside the model volume. */}}
{{- define "pdserve.modelDir" -}}
{{- $dir := trimAll "/" .Values.model.dir -}}
{{- if $dir -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) $dir -}}
{{- else -}}
{{- trimSuffix "/" .Values.model.mountPath -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" (include "pdserve.fullname" .)) .Values.model.pvc.existingClaim }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.initContainer.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}

{{/* The init container that fills the model volume when model.source=initContainer:
(dict "root" $ "component" "prefill"). It sees PDSERVE_MODEL_DIR (= --model). */}}
{{- define "pdserve.modelInitContainer" -}}
{{- $root := .root -}}
{{- $init := $root.Values.model.initContainer -}}
{{- if eq $root.Values.model.source "initContainer" }}
- name: fetch-model
  image: {{ default (include "pdserve.image" .) $init.image }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: {{- toYaml $init.command | nindent 4 }}
  args: {{- toYaml $init.args | nindent 4 }}
  env:
    - name: PDSERVE_MODEL_DIR
      value: {{ include "pdserve.modelDir" $root | quote }}
    {{- include "pdserve.cacheEnv" $root | nindent 4 }}
    {{- with $init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources: {{- toYaml $init.resources | nindent 4 }}
  securityContext: {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $root.Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/* Caches go to the writable /tmp (the root file system is read-only). */}}
{{- define "pdserve.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- end -}}

{{/* OMP_NUM_THREADS for a CPU-mode worker: its CPU request divided among its ranks
(at least 1): (dict "cpu" "4" "ranks" 2) → 2. Accepts "500m", "2", 2, 1.5. */}}
{{- define "pdserve.ompThreads" -}}
{{- $cpu := toString (default "1" .cpu) -}}
{{- $milli := 0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $milli = atoi (trimSuffix "m" $cpu) -}}
{{- else -}}
{{- $milli = int (mulf (float64 $cpu) 1000) -}}
{{- end -}}
{{- max 1 (div $milli (mul 1000 (int .ranks))) -}}
{{- end -}}

{{/* A worker's resources: its values, plus gpu.resourceName = tensorParallelSize in both
requests and limits when gpu.enabled (one GPU per rank): (dict "root" $ "values" .Values.decode) */}}
{{- define "pdserve.workerResources" -}}
{{- $res := deepCopy (default dict .values.resources) -}}
{{- if .root.Values.gpu.enabled -}}
{{- $tp := int .values.tensorParallelSize -}}
{{- $requests := default dict $res.requests -}}
{{- $limits := default dict $res.limits -}}
{{- $_ := set $requests .root.Values.gpu.resourceName $tp -}}
{{- $_ = set $limits .root.Values.gpu.resourceName $tp -}}
{{- $_ = set $res "requests" $requests -}}
{{- $_ = set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Spread a component's pods over the topology keys of .Values.topologySpread:
(dict "root" $ "component" "decode") */}}
{{- define "pdserve.topologySpread" -}}
{{- $ctx := . -}}
{{- if .root.Values.topologySpread.enabled }}
topologySpreadConstraints:
{{- range .root.Values.topologySpread.constraints }}
  - topologyKey: {{ .topologyKey }}
    maxSkew: {{ .maxSkew }}
    whenUnsatisfiable: {{ .whenUnsatisfiable }}
    labelSelector:
      matchLabels: {{- include "pdserve.selectorLabels" $ctx | nindent 8 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level scheduling and security shared by every pdserve pod:
(dict "root" $ "values" .Values.prefill "gpu" true) */}}
{{- define "pdserve.podCommon" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
automountServiceAccountToken: false
securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and .gpu $root.Values.gpu.enabled $root.Values.gpu.runtimeClassName }}
runtimeClassName: {{ $root.Values.gpu.runtimeClassName }}
{{- end }}
{{- $nodeSelector := .values.nodeSelector -}}
{{- $tolerations := .values.tolerations -}}
{{- if and .gpu $root.Values.gpu.enabled -}}
{{- $nodeSelector = merge (deepCopy (default dict .values.nodeSelector)) (default dict $root.Values.gpu.nodeSelector) -}}
{{- $tolerations = concat (default list .values.tolerations) (default list $root.Values.gpu.tolerations) -}}
{{- end }}
{{- with $nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* One of a component's probes: its action plus the timings from values:
(dict "action" (dict "grpc" (dict "port" 50061)) "timing" .Values.prefill.probes.liveness) */}}
{{- define "pdserve.probe" -}}
{{- toYaml (merge (deepCopy .action) (deepCopy .timing)) -}}
{{- end -}}

{{/* Fails the render, naming the value, on settings that cannot work. */}}
{{- define "pdserve.validate" -}}
{{- if not (has .Values.model.source (list "pvc" "hostPath" "initContainer")) -}}
{{- fail (printf "model.source must be pvc, hostPath or initContainer, not %q" .Values.model.source) -}}
{{- end -}}
{{- if not (has .Values.workers.layout (list "split" "pooled")) -}}
{{- fail (printf "workers.layout must be split or pooled, not %q" .Values.workers.layout) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" "pool" -}}
{{- if lt (int (index $.Values $role).tensorParallelSize) 1 -}}
{{- fail (printf "%s.tensorParallelSize must be at least 1" $role) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.router.tls.enabled (not .Values.router.tls.secretName) -}}
{{- fail "router.tls.secretName (a kubernetes.io/tls Secret) is required when router.tls.enabled" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.host) -}}
{{- fail "redis.external.host is required when redis.enabled=false" -}}
{{- end -}}
{{- if include "pdserve.pooled" . -}}
{{- include "pdserve.validatePool" . -}}
{{- else if and (eq (int .Values.prefill.replicas) 0) (eq .Values.router.localPrefill "never") (not .Values.prefill.autoscaling.enabled) -}}
{{- fail "prefill.replicas=0 needs router.localPrefill=always or fallback (decode workers prefill)" -}}
{{- end -}}
{{- if and .Values.pool.autoscaling.enabled (not (include "pdserve.pooled" .)) -}}
{{- fail "pool.autoscaling.enabled needs workers.layout=pooled (the split layout scales with prefill/decode.autoscaling)" -}}
{{- end -}}
{{- end -}}
