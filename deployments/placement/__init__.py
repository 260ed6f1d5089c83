"""Placement chosen by measurement: a calibration profile of one GPU and a mix of traffic in, the
capacity of colocated replicas and of every encoder:decoder split out (`python -m deployments.placement`)."""
