"""zarrlake's test kit: what the tests, the e2e scenario and the benchmarks run against.

- :mod:`zarrlake_testkit.servers`: real servers (``moto_server``, SeaweedFS's ``weed server
  -s3``, ``redis-server``) on loopback ports, started as child processes and stopped by process
  id.
- :mod:`zarrlake_testkit.s3proxy`: an S3 server that ignores conditional writes, made of a real
  one behind a header-stripping proxy.
- :mod:`zarrlake_testkit.contract`: a storage that lists as loosely as the listing contract
  allows.
- :mod:`zarrlake_testkit.counting`: a storage wrapper that counts requests.
- :mod:`zarrlake_testkit.kubeapi`: a Kubernetes API server over HTTP (built on KMock).
- :mod:`zarrlake_testkit.emulated`: the controllers that API server lacks, played by local
  processes.
- :mod:`zarrlake_testkit.stress`: a test command run repeatedly beside CPU burners.

Installed only for development (``make test`` installs it); the product never imports it.
"""
