#!/usr/bin/env bash
# Prints alerts.yaml wrapped in a PrometheusRule (monitoring.coreos.com/v1)
# for the Prometheus operator:
#   bash deploy/monitoring/prometheusrule.sh | kubectl apply -n logprob -f -
# Add the label your Prometheus' ruleSelector expects with EXTRA_LABELS, e.g.
#   EXTRA_LABELS='release: kube-prometheus-stack' bash deploy/monitoring/prometheusrule.sh
set -euo pipefail
here=$(dirname "$0")
cat <<HEAD
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: logprob
  labels:
    app.kubernetes.io/name: logprob-service
HEAD
if [ -n "${EXTRA_LABELS:-}" ]; then echo "    ${EXTRA_LABELS}"; fi
echo "spec:"
grep -v '^#' "$here/alerts.yaml" | sed 's/^/  /'
