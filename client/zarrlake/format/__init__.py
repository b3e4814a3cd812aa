"""The on-storage format: ids, the object envelope, snapshots, manifests, txlogs, refs.

Nothing here knows about Zarr's API or about any storage backend.
"""
