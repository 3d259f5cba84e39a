"""Several hosts on one Linux machine for tests, benchmarks and users (root only).

`netns.Network` builds hosts (network namespaces on a bridge, a private subnet), shapes their
links (tc tbf), takes links down and partitions pairs of hosts; `cluster.HostCluster` runs
routers, P and D workers and Redis in chosen hosts as real processes, started through
duplexkv/launch. The runtime package never imports this one (tests/test_layering.py).
"""
