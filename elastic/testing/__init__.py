"""What the tests and the benchmarks both run the product with, none of it imported by the
product itself: a real S3 API server on loopback (``s3``), loopback ports and waiting on a
condition (``loopback``), the reference model at a real step time (``paced``), real gloo
process groups without a cluster (``gloo_ranks``), Ray's workers forked from a server that
imported torch once (``forked_ray_workers``), a process's memory (``memory``) and the
losses' comparison (``losses``). ``bench/`` imports these, never ``tests/``."""
