"""Transactional mirroring: read-only replicas that only ever show complete commits.

:class:`Mirror` watches a source repository and, for each mirrored branch and tag, moves the
destination's ref to the source's newest head only once every object that head needs is at the
destination — copied by the mirror itself (``copy=True``) or by bucket replication, in any
order. See :mod:`zarrlake.mirror.promoter` for the pass, :mod:`~zarrlake.mirror.closure` for what
a head needs and :mod:`~zarrlake.mirror.presence` for why a pass checks only new objects.
"""

from zarrlake.mirror.promoter import CopyProgress, Mirror, MirrorStatus, RefStatus

__all__ = ["CopyProgress", "Mirror", "MirrorStatus", "RefStatus"]
