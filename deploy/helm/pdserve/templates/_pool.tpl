{{/*
The pooled layout (workers.layout=pooled): one worker StatefulSet whose roles are runtime
state, and the planner that switches them. What the pool's pods, the planner and the HPA
share lives here: the pods' entrypoint, the planner's profile and size bounds, and the
checks that fail the render on settings that cannot work.
*/}}

{{/* The pool pods' command: a POSIX shell that picks the role a pod starts in from its
StatefulSet ordinal (the digits after the last "-" of $POD_NAME; below
$PDSERVE_INITIAL_PREFILL: prefill, else decode), then becomes `pdserve worker --role ROLE`
followed by the container's args. The last item is the shell's $0. The script holds no
"$(" and no "$$": Kubernetes expands those in a command, and would change it. */}}
{{- define "pdserve.poolCommand" -}}
- /bin/sh
- -euc
- |
  ordinal="${POD_NAME##*-}"
  case "$ordinal" in
    ''|*[!0-9]*) echo "pdserve pool: no StatefulSet ordinal in the pod name '$POD_NAME'" >&2; exit 2 ;;
  esac
  role=decode
  if [ "$ordinal" -lt "$PDSERVE_INITIAL_PREFILL" ]; then role=prefill; fi
  echo "pdserve pool: $POD_NAME (ordinal $ordinal) starts as a $role worker" >&2
  exec pdserve worker --role "$role" "$@"
- pdserve-pool
{{- end -}}

{{/* The fewest workers the planner may want (--min-workers) and the pool HPA's
minReplicas: planner.minWorkers, or minPrefill + minDecode when that is 0. */}}
{{- define "pdserve.plannerMinWorkers" -}}
{{- $p := .Values.planner -}}
{{- default (add (int $p.minPrefill) (int $p.minDecode)) (int $p.minWorkers) -}}
{{- end -}}

{{/* The planner's profile as JSON text: planner.profile itself when a string, else the
object written as JSON; "" when none is given (null, the default). */}}
{{- define "pdserve.plannerProfile" -}}
{{- $profile := .Values.planner.profile -}}
{{- if kindIs "invalid" $profile -}}
{{- else if kindIs "string" $profile -}}
{{- $profile -}}
{{- else -}}
{{- toPrettyJson $profile -}}
{{- end -}}
{{- end -}}

{{/* Fails the render, naming the value, on pool settings that cannot work. The planner's
bounds come first: the pool's size with the HPA is the planner's minimum. */}}
{{- define "pdserve.validatePool" -}}
{{- $pool := .Values.pool -}}
{{- $autoscaled := $pool.autoscaling.enabled -}}
{{- if and $autoscaled (not .Values.planner.enabled) -}}
{{- fail "pool.autoscaling.enabled needs planner.enabled: the HPA follows the planner's desired cluster size" -}}
{{- end -}}
{{- if and $autoscaled (not .Values.planner.maxWorkers) -}}
{{- fail "pool.autoscaling.enabled needs planner.maxWorkers (the HPA's maxReplicas; without it the planner does not size the cluster)" -}}
{{- end -}}
{{- if .Values.planner.enabled -}}
{{- include "pdserve.validatePlanner" . -}}
{{- end -}}
{{- $size := ternary (int (include "pdserve.plannerMinWorkers" .)) (int $pool.replicas) $autoscaled -}}
{{- if ge (int $pool.initialPrefill) $size -}}
{{- fail (printf "pool.initialPrefill (%d) must leave at least one decode worker: below %s (%d)" (int $pool.initialPrefill) (ternary "the planner's minimum workers" "pool.replicas" $autoscaled) $size) -}}
{{- end -}}
{{- if and (eq (int $pool.initialPrefill) 0) (eq .Values.router.localPrefill "never") -}}
{{- fail "pool.initialPrefill=0 needs router.localPrefill=always or fallback (decode workers prefill)" -}}
{{- end -}}
{{- end -}}

{{/* Fails the render on planner settings that cannot work, before the planner itself
would refuse them at start: no profile, or none for the pool's TP size; bounds that
PlannerConfig rejects. */}}
{{- define "pdserve.validatePlanner" -}}
{{- $p := .Values.planner -}}
{{- if not .Values.metrics.enabled -}}
{{- fail "planner.enabled needs metrics.enabled: the planner reads every worker's /metrics, and the HPA reads the planner's" -}}
{{- end -}}
{{- $text := include "pdserve.plannerProfile" . | trim -}}
{{- if not $text -}}
{{- fail "planner.profile is required when the planner runs (workers.layout=pooled, planner.enabled): the workers' step-time profile JSON (python -m bench.profile --json profile.json), e.g. --set-file planner.profile=profile.json" -}}
{{- end -}}
{{- $profile := fromJson $text -}}
{{- if hasKey $profile "Error" -}}
{{- fail (printf "planner.profile is not a JSON object: %s" $profile.Error) -}}
{{- end -}}
{{- $tp := toString (int .Values.pool.tensorParallelSize) -}}
{{- $steps := get $profile "steps" -}}
{{- if not (and (kindIs "map" $steps) (hasKey $steps $tp)) -}}
{{- fail (printf "planner.profile has no steps at TP %s (pool.tensorParallelSize): profile the workers at that size" $tp) -}}
{{- end -}}
{{- if and (eq (int $p.minPrefill) 0) (eq .Values.router.localPrefill "never") -}}
{{- fail "planner.minPrefill=0 needs router.localPrefill=always or fallback (decode workers prefill)" -}}
{{- end -}}
{{- $floor := add (int $p.minPrefill) (int $p.minDecode) -}}
{{- if and (int $p.minWorkers) (not (int $p.maxWorkers)) -}}
{{- fail "planner.minWorkers needs planner.maxWorkers (the planner sizes the cluster only with it)" -}}
{{- end -}}
{{- if and (int $p.minWorkers) (lt (int $p.minWorkers) $floor) -}}
{{- fail (printf "planner.minWorkers (%d) must be at least planner.minPrefill + planner.minDecode (%d)" (int $p.minWorkers) $floor) -}}
{{- end -}}
{{- $min := int (include "pdserve.plannerMinWorkers" .) -}}
{{- if and (int $p.maxWorkers) (lt (int $p.maxWorkers) $min) -}}
{{- fail (printf "planner.maxWorkers (%d) must be at least the minimum workers (%d)" (int $p.maxWorkers) $min) -}}
{{- end -}}
{{- end -}}
