"""The zarrlake Kubernetes operator: Repository, Branch, Tag and RetentionPolicy resources.

Layers: ``models`` (the resources; CRDs are generated from them by ``crds``), ``desired`` (pure
functions: spec + observed state -> objects and status), ``reconcile`` (one idempotent
reconciliation per kind), ``handlers`` (thin Kopf glue), and the edges ``kube`` (Kubernetes API),
``buckets`` (S3 through boto3) and ``metrics`` (Prometheus).
"""
