#!/usr/bin/env bash
# The e2e scenario on a real cluster: kind + Docker + kubectl + helm (not runnable on machines
# without a Docker engine; `make e2e` is the emulated version that runs anywhere).
#
#   e2e/kind.sh            # create cluster "zarrlake-e2e", build and load the image, run, keep
#   KEEP=0 e2e/kind.sh     # delete the cluster afterwards
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-zarrlake-e2e}
IMAGE=${IMAGE:-zarrlake:e2e}
NS=${NS:-zarrlake-e2e}
KEEP=${KEEP:-1}
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "e2e/kind.sh needs $tool on PATH" >&2; exit 2; }
done
step() { printf '\n==> %s\n' "$*"; }
wait_for() {  # wait_for DESCRIPTION SECONDS COMMAND...
  local what=$1 secs=$2; shift 2
  for _ in $(seq "$secs"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "timed out waiting for $what" >&2; exit 1
}

step "cluster and image"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -

step "an S3 API inside the cluster (moto), standing in for a real object store"
kubectl -n "$NS" apply -f e2e/kind/s3.yaml
kubectl -n "$NS" rollout status deployment/s3 --timeout=180s

step "helm install the operator"
helm upgrade --install zarrlake-operator charts/zarrlake-operator -n "$NS" \
  --set image.repository="${IMAGE%%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=IfNotPresent --set jobImage="$IMAGE" --wait --timeout 180s

step "apply examples/kubernetes with this cluster's overlay"
kubectl apply -k e2e/kind -n "$NS"
kubectl -n "$NS" wait repository/climate --for=jsonpath='{.status.phase}'=Ready --timeout=240s
kubectl -n "$NS" get zarrlake

step "write data from a pod through Repository.from_kubernetes"
sed "s|IMAGE|$IMAGE|" e2e/kind/writer-job.yaml | kubectl -n "$NS" apply -f -
kubectl -n "$NS" wait job/writer --for=condition=complete --timeout=300s
kubectl -n "$NS" logs job/writer

step "Branch and Tag"
kubectl -n "$NS" apply -f examples/kubernetes/branch.yaml -f examples/kubernetes/tag.yaml
kubectl -n "$NS" wait branch/experiment-1 --for=condition=Ready --timeout=120s
kubectl -n "$NS" wait tag/v1 --for=condition=Ready --timeout=120s
kubectl -n "$NS" get branches,tags -o wide

step "run the GC CronJob now"
CRON=$(kubectl -n "$NS" get retentionpolicy climate-retention -o jsonpath='{.status.gcCronJob}')
kubectl -n "$NS" delete job gc-now --ignore-not-found
kubectl -n "$NS" create job gc-now --from="cronjob/$CRON"
kubectl -n "$NS" wait job/gc-now --for=condition=complete --timeout=300s
wait_for "lastGC in the policy status" 120 bash -c \
  "kubectl -n $NS get retentionpolicy climate-retention -o jsonpath='{.status.lastGC.job}' | grep -qx gc-now"
kubectl -n "$NS" get retentionpolicies
RESULT=$(kubectl -n "$NS" get retentionpolicy climate-retention -o jsonpath='{.status.lastGC.result}')
[ "$RESULT" = Succeeded ] || { echo "GC result: $RESULT" >&2; exit 1; }

step "delete the Branch and the Tag"
kubectl -n "$NS" delete -f examples/kubernetes/branch.yaml -f examples/kubernetes/tag.yaml --wait
kubectl -n "$NS" get events --sort-by=.metadata.creationTimestamp | tail -20

step "kind e2e passed"
[ "$KEEP" = 1 ] || kind delete cluster --name "$CLUSTER"
