"""The zarrlake Kubernetes operator: Repository, Branch, Tag and RetentionPolicy resources.

Layers: ``models`` (the kinds; the resource models themselves are the client's
:mod:`zarrlake.resources`, and ``crds`` generates the CRDs from them), ``desired`` (pure
functions: spec + observed state -> objects and status), ``reconcile`` (one idempotent
reconciliation per kind), ``handlers`` (thin Kopf glue), and the edges ``kube`` (Kubernetes API),
``buckets`` (buckets through boto3, repository data through ``zarrlake.Storage``) and ``metrics``
(Prometheus).
"""
