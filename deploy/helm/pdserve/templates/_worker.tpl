{{/*
The pod template of a worker: (dict "root" $ "component" "decode"), the component being
prefill or decode (split layout: `pdserve prefill|decode`, the role fixed) or pool (pooled
layout: `pdserve worker --role ROLE`, started by pdserve.poolCommand in the role the pod's
ordinal gives; the planner switches it later). Its values are .Values.COMPONENT.
All ranks of a tensor-parallel group run in this one pod (the worker spawns them), so a
worker asks for tensorParallelSize GPUs. The worker registers $(POD_IP) in Redis
(--advertise-host) and binds 0.0.0.0; its gRPC port answers grpc.health.v1, which the
startup, liveness and readiness probes ask (health needs no cluster token; every other
call on that port, and the KV handshake, needs $PDSERVE_CLUSTER_TOKEN).
*/}}
{{- define "pdserve.workerPodTemplate" -}}
{{- $root := .root -}}
{{- $component := .component -}}
{{- $pooled := eq $component "pool" -}}
{{- $v := index $root.Values $component -}}
{{- $ctx := dict "root" $root "component" $component -}}
{{- /* A decode worker's KV store port; any pool pod may become a decode worker. */ -}}
{{- $kv := has $component (list "decode" "pool") -}}
{{- $grpc := dict "grpc" (dict "port" (int $v.port)) -}}
metadata:
  labels: {{- include "pdserve.labels" $ctx | nindent 4 }}
  {{- with $v.podAnnotations }}
  annotations: {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "pdserve.podCommon" (dict "root" $root "values" $v "gpu" true) | nindent 2 }}
  terminationGracePeriodSeconds: {{ add (int $v.grace) 15 }}
  {{- with (include "pdserve.topologySpread" $ctx | trim) }}{{ . | nindent 2 }}{{ end }}
  {{- with (include "pdserve.modelInitContainer" $ctx) }}
  initContainers: {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "worker" $component $pooled }}
      image: {{ include "pdserve.image" $ctx }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- if $pooled }}
      # `pdserve worker --role ROLE` and the args below, ROLE from the pod's ordinal.
      command: {{- include "pdserve.poolCommand" $root | nindent 8 }}
      {{- end }}
      args:
        {{- if not $pooled }}
        - {{ $component }}
        {{- end }}
        - --model
        - {{ include "pdserve.modelDir" $root | quote }}
        - --host
        - 0.0.0.0
        - --advertise-host
        - $(POD_IP)
        - --port
        - {{ $v.port | quote }}
        {{- if $kv }}
        - --kv-port
        - {{ $v.kvPort | quote }}
        {{- end }}
        - --tensor-parallel-size
        - {{ $v.tensorParallelSize | quote }}
        - --cluster
        - {{ include "pdserve.clusterKey" $root | quote }}
        - --worker-id
        - $(POD_NAME)
        - --grace
        - {{ $v.grace | quote }}
        {{- if $root.Values.metrics.enabled }}
        - --metrics-port
        - {{ $root.Values.metrics.port | quote }}
        {{- end }}
        {{- if $root.Values.gpu.enabled }}
        - --device
        - cuda
        - --dtype
        - {{ $root.Values.gpu.dtype }}
        {{- end }}
        {{- if $pooled }}
        - --max-num-batched-tokens
        - {{ $v.maxNumBatchedTokens | quote }}
        {{- end }}
        {{- with $v.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        - name: POD_IP
          valueFrom:
            fieldRef: {fieldPath: status.podIP}
        - name: POD_NAME
          valueFrom:
            fieldRef: {fieldPath: metadata.name}
        {{- if $pooled }}
        - name: PDSERVE_INITIAL_PREFILL
          value: {{ $v.initialPrefill | quote }}
        {{- end }}
        {{- include "pdserve.redisEnv" $root | trim | nindent 8 }}
        {{- with (include "pdserve.clusterTokenEnv" $root | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- include "pdserve.cacheEnv" $root | nindent 8 }}
        {{- if not $root.Values.gpu.enabled }}
        # CPU mode: each rank gets its share of the CPU request (oversubscribed OpenMP
        # pools make every step slower).
        - name: OMP_NUM_THREADS
          value: {{ include "pdserve.ompThreads" (dict "cpu" (dig "requests" "cpu" "1" $v.resources) "ranks" $v.tensorParallelSize) | quote }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.port }}
        {{- if $kv }}
        - name: kv
          containerPort: {{ $v.kvPort }}
        {{- end }}
        {{- if $root.Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ $root.Values.metrics.port }}
        {{- end }}
      startupProbe: {{- include "pdserve.probe" (dict "action" $grpc "timing" $v.probes.startup) | nindent 8 }}
      livenessProbe: {{- include "pdserve.probe" (dict "action" $grpc "timing" $v.probes.liveness) | nindent 8 }}
      readinessProbe: {{- include "pdserve.probe" (dict "action" $grpc "timing" $v.probes.readiness) | nindent 8 }}
      resources: {{- include "pdserve.workerResources" (dict "root" $root "values" $v) | nindent 8 }}
      securityContext: {{- toYaml $root.Values.containerSecurityContext | nindent 8 }}
      volumeMounts:
        {{- include "pdserve.modelMount" $root | nindent 8 }}
        - name: tmp
          mountPath: /tmp
        - name: dshm
          mountPath: /dev/shm
  volumes:
    {{- include "pdserve.modelVolume" $root | nindent 4 }}
    - name: tmp
      emptyDir: {}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSizeLimit }}
{{- end -}}
